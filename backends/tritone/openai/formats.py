"""OpenAI's response bodies and stream chunks, made from the ensemble's chunks: completions and
chat completions, whole or as server-sent events."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tritone_client.client import Chunk

from tritone.openai.tools import ToolCall, parse_tool_calls
from tritone.text import reasoning

# The engine's finish reasons (tritone.scheduling.request.FinishReason, "" while the request runs)
# as OpenAI's: stop and length are the same words; cancelled and error pass as they are.
_OPENAI_FINISH_REASONS = {"": None, "stop": "stop", "length": "length"}


def openai_finish_reason(engine_reason: str, called_tools: bool = False) -> str | None:
    """OpenAI's finish reason for the engine's; an answer that stopped after calling tools
    finished for tool_calls."""
    reason = _OPENAI_FINISH_REASONS.get(engine_reason, engine_reason)
    return "tool_calls" if called_tools and reason == "stop" else reason


def sse(payload: dict | str) -> bytes:
    """One server-sent event: a JSON body, or a bare word such as [DONE]."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _token(text: str, log_prob: float) -> dict:
    # As vLLM: the bytes of the token's text as decoded alone (a piece of a character reads U+FFFD).
    return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}


def _usage(chunk: Chunk) -> dict:
    return {"prompt_tokens": chunk.num_input_tokens, "completion_tokens": chunk.num_output_tokens,
            "total_tokens": chunk.num_input_tokens + chunk.num_output_tokens}


@dataclass(slots=True)
class ResponseFormat:
    """The bodies of one answer: `whole` for a whole answer, or `start`, `delta`s (and
    `tool_delta`), then `usage` for a stream."""

    id: str
    created: int
    model: str
    wants_logprobs: bool
    # The tool-call syntax to parse the answer by (chat with tools), else None.
    tool_parser: str | None = None
    # Tool calls went out in the stream: its end finishes for tool_calls.
    called_tools: bool = False
    # The thinking syntax to take the reasoning apart by (chat with --reasoning-parser), else None.
    reasoning_parser: str | None = None

    def _envelope(self, object_: str, choices: list, usage=None, with_usage_key: bool = False) -> dict:
        """OpenAI's envelope; with include_usage, every chunk has a usage key (null but in the last)."""
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return body

    def _finish_reason(self, chunk: Chunk) -> str | None:
        return openai_finish_reason(chunk.finish_reason, self.called_tools)


class CompletionFormat(ResponseFormat):
    def _logprobs(self, top: list, index: int = 0):
        """OpenAI's legacy shape from the ensemble's top_log_probs ([text, log-probability,
        [[text, log-probability], ...]] per token)."""
        if not self.wants_logprobs:
            return None
        # Where the next token's text starts in each choice (text_offset), across a stream's chunks.
        num_chars = self.__dict__.setdefault("num_chars", {})
        offsets = []
        for text, _, _ in top:
            offsets.append(num_chars.get(index, 0))
            num_chars[index] = offsets[-1] + len(text)
        return {"tokens": [t[0] for t in top], "token_logprobs": [t[1] for t in top],
                # None for an echoed prompt's first token, which nothing precedes (as vLLM).
                "top_logprobs": [None if t[1] is None else dict((text, lp) for text, lp in t[2]) for t in top],
                "text_offset": offsets}

    def _choice(self, c: Chunk, index: int = 0) -> dict:
        return {"index": index, "text": c.text, "logprobs": self._logprobs(c.top_log_probs, index),
                "finish_reason": self._finish_reason(c)}

    def whole(self, a: Chunk) -> dict:
        return self._envelope("text_completion", [self._choice(a)], _usage(a))

    def wholes(self, answers: list[Chunk], usage: Chunk) -> dict:
        """Several choices, indexed in order."""
        return self._envelope("text_completion", [self._choice(a, i) for i, a in enumerate(answers)], _usage(usage))

    def start(self, include_usage: bool, index: int = 0) -> dict:
        return self.delta(Chunk("", 0, 0, 0.0, [], ""), include_usage, index=index)

    def delta(self, c: Chunk, include_usage: bool, continuous_usage: bool = False, reasoning: str = "",
              index: int = 0) -> dict:
        # No reasoning_content in completions: as in vLLM, only chat is split (`reasoning` stays "").
        return self._envelope("text_completion", [self._choice(c, index)], _usage(c) if continuous_usage else None,
                              include_usage)

    def usage(self, last: Chunk) -> dict:
        return self._envelope("text_completion", [], _usage(last))


class ChatFormat(ResponseFormat):
    def _logprobs(self, top: list):
        if not self.wants_logprobs:
            return None
        return {"content": [{**_token(text, lp), "top_logprobs": [_token(*alt) for alt in alternatives]}
                            for text, lp, alternatives in top]}

    def whole(self, a: Chunk) -> dict:
        return self._envelope("chat.completion", [self._whole_choice(a)], _usage(a))

    def wholes(self, answers: list[Chunk], usage: Chunk) -> dict:
        """Several choices, indexed in order."""
        return self._envelope("chat.completion", [self._whole_choice(a, i) for i, a in enumerate(answers)],
                              _usage(usage))

    def _whole_choice(self, a: Chunk, index: int = 0) -> dict:
        message = {"role": "assistant", "content": a.text}
        if self.reasoning_parser:  # vLLM's field, null where the model did not think
            thought, message["content"] = reasoning.split(self.reasoning_parser, a.text)
            message["reasoning_content"] = thought
        called_tools = False
        if self.tool_parser and message["content"]:  # the calls are in the answer, not in the thinking
            content, calls = parse_tool_calls(message["content"], self.tool_parser)
            if calls:
                message |= {"content": content, "tool_calls": [c.as_openai() for c in calls]}
                called_tools = True
        return {"index": index, "message": message, "logprobs": self._logprobs(a.top_log_probs),
                "finish_reason": openai_finish_reason(a.finish_reason, called_tools)}

    def tool_delta(self, calls: list[ToolCall], include_usage: bool) -> dict:
        # Each call whole in one delta: its id, name and all its arguments.
        self.called_tools = True
        choice = {"index": 0, "delta": {"tool_calls": [c.as_openai(i) for i, c in enumerate(calls)]},
                  "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], None, include_usage)

    def start(self, include_usage: bool, index: int = 0) -> dict:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], with_usage_key=include_usage)

    def delta(self, c: Chunk, include_usage: bool, continuous_usage: bool = False, reasoning: str = "",
              index: int = 0) -> dict:
        """A chunk's content delta, after its `reasoning` piece where it has one."""
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if c.text:
            delta["content"] = c.text
        choice = {"index": index, "delta": delta,
                  "logprobs": self._logprobs(c.top_log_probs), "finish_reason": self._finish_reason(c)}
        return self._envelope("chat.completion.chunk", [choice], _usage(c) if continuous_usage else None,
                              include_usage)

    def usage(self, last: Chunk) -> dict:
        return self._envelope("chat.completion.chunk", [], _usage(last))
