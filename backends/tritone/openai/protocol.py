"""OpenAI's request bodies, checked, and what each becomes as `ensemble` inputs.

Only what the engine can honour is accepted: an unsupported feature (suffix, ...) is refused
with a 400 that names it, and an unknown field is refused too, never ignored.

Structured outputs take OpenAI's `response_format` and vLLM's extras (`guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`); each becomes the
ensemble's `guided_decoding_guide_type` / `guided_decoding_guide`, as TensorRT-LLM names them.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from tritone.openai.errors import RequestError
from tritone.openai.guides import add_guide, guide_text, response_format_guide
from tritone.openai.sendable import first_unsendable
from tritone.openai.tools import tool_guide

logger = logging.getLogger("tritone.openai")
# When a request sets no max_tokens: OpenAI's documented default for completions; for chat,
# where OpenAI runs to the end of the context, a bound that fits any prompt of the default model.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
# Integers become int32 tensors, floats float32 ones: numpy wraps an out-of-range int and turns
# an out-of-range float into inf, so a value is refused unless it fits as it is.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
# OpenAI's limits on logit_bias (the engine holds the same: tritone.scheduling.request).
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS = 100.0, 300
# OpenAI's most alternatives per token: completions' logprobs 5, chat's top_logprobs 20.
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20
# Prompts of one completions request: each is a request of the engine's, all submitted at once.
MAX_PROMPTS = 64
# Sequences per prompt (n, best_of): each is a request of the engine's.
MAX_CHOICES = 8
Float32 = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: usage so far in every chunk (the throughput script counts tokens by it).
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields common to completions and chat, with vLLM's extras that benchmark tools send."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # metadata only
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)  # 0: no top-k, as the engine has it
    min_p: Float32 | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    repetition_penalty: Float32 | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def guide(self) -> tuple[str, str, str] | None:
        """(the field the constraint came from, guide type, guide text), or None; at most one
        constraint per request."""
        found = []
        if self.response_format is not None:
            found += response_format_guide(self.response_format)
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "ebnf_grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, kind, value))
        for key, value in (self.structured_outputs or {}).items():
            kind = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
                    "json_object": "json", "structural_tag": "structural_tag"}.get(key)
            if kind is None:
                raise RequestError(f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                                   f"json_object, structural_tag)", f"structured_outputs.{key}")
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}", kind, value))
        if len(found) > 1:
            raise RequestError(f"give one output constraint, not {len(found)}: {', '.join(f[0] for f in found)}",
                               found[1][0])
        if not found:
            return None
        field, kind, value = found[0]
        return (field, *guide_text(field, kind, value))

    def check_supported(self) -> None:
        self._check_sendable()
        if self.n > MAX_CHOICES:
            raise RequestError(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        self._check_logit_bias()
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")

    def _check_logit_bias(self) -> None:
        """OpenAI's rules; the engine refuses an id outside the model's vocabulary."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise RequestError(f"logit_bias holds {len(bias)} tokens, over the limit of {MAX_LOGIT_BIAS_TOKENS}",
                               "logit_bias")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()):
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not abs(value) <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias of token {key} must be in [-100, 100], got {value}", "logit_bias")

    @property
    def num_seqs(self) -> int:
        """Sequences to generate for each prompt: best_of where given, else n."""
        return getattr(self, "best_of", None) or self.n

    def sampling_inputs(self, max_tokens: int, index: int = 0) -> dict[str, np.ndarray]:
        """The ensemble's sampling inputs for a prompt's `index`th sequence. OpenAI samples at
        temperature 1 when none is given (the ensemble alone would decode greedily, as TensorRT-LLM
        does). Sequence i of a seeded request draws from seed + i (modulo 2**64), so that n seeded
        choices are the answers of single requests with those seeds."""
        seed = None if self.seed is None else (self.seed + index) % (1 << 64)
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        values = {
            "max_tokens": (max_tokens, np.int32),
            "temperature": (1.0 if self.temperature is None else self.temperature, np.float32),
            "top_p": (self.top_p, np.float32), "top_k": (self.top_k, np.int32), "min_p": (self.min_p, np.float32),
            "presence_penalty": (self.presence_penalty, np.float32),
            "frequency_penalty": (self.frequency_penalty, np.float32),
            "repetition_penalty": (self.repetition_penalty, np.float32),
            "min_tokens": (self.min_tokens, np.int32), "seed": (seed, np.uint64),
            "end_id": (-1 if self.ignore_eos else None, np.int32),
            "stream": (self.stream, np.bool_),
        }
        inputs = {name: np.array([[value]], dtype=dtype) for name, (value, dtype) in values.items() if value is not None}
        if self.logit_bias:
            inputs["logit_bias"] = np.array([[json.dumps(self.logit_bias).encode()]], dtype=object)
        if stop:
            inputs["stop_words"] = np.array([[s.encode() for s in stop]], dtype=object)
        guide = self.guide()
        if guide is not None:
            add_guide(inputs, guide[1], guide[2])
        return inputs

    def _check_sendable(self) -> None:
        """Refuses what cannot go on to the ensemble as it is: text that is not UTF-8 (JSON's
        escapes can spell a lone surrogate), a float that is not finite (Python's JSON reads
        NaN and Infinity; json.dumps would write them out as invalid JSON), nesting too deep."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name not in self.model_fields_set or value is None:
                continue
            fault = first_unsendable(value.model_dump() if isinstance(value, BaseModel) else value, name)
            if fault is not None:
                raise RequestError(f"{fault[0]} {fault[1]}", fault[0])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


TokenIds = list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]]  # strict: true and false are no token ids


class CompletionRequest(_Sampling):
    # Text, token ids, or a list of either (one choice each, as OpenAI's).
    prompt: str | list[str] | TokenIds | list[TokenIds]
    # 0 only with echo: the prompt scored, nothing generated (lm-evaluation-harness's log-likelihood).
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=0, le=INT32_MAX)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and not 1 <= len(self.prompts) <= MAX_PROMPTS:
            raise RequestError(f"prompt must be a string, token ids or a list of 1 to {MAX_PROMPTS} of either, got "
                               f"{len(self.prompts)}", "prompt")
        if any(not p for p in self.prompts):
            raise RequestError("prompt holds an empty list of token ids", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens may be 0 only with echo (the prompt scored, nothing generated)",
                               "max_tokens")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_CHOICES:
            raise RequestError(f"best_of must be in [n, {MAX_CHOICES}], got {self.best_of} with n {self.n}", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise RequestError("best_of above n cannot be streamed (as in OpenAI's API)", "best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.logprobs is not None and self.logprobs > MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}", "logprobs")

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or its token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p

    def ensemble_inputs(self, prompt: str | list[int] | None = None, index: int = 0) -> dict[str, np.ndarray]:
        prompt = self.prompts[0] if prompt is None else prompt
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        # max_tokens 0: one token is generated with the prompt's scores, and dropped (Echo).
        inputs = self.sampling_inputs(max(1, max_tokens), index)
        if isinstance(prompt, str):
            # A completion continues the text as it is: no chat template.
            inputs["text_input"] = np.array([[prompt.encode()]], dtype=object)
            inputs["apply_chat_template"] = np.array([[False]])
        else:
            inputs["prompt_token_ids"] = np.array([prompt], dtype=np.int32)
        if self.logprobs is not None:
            inputs["num_top_log_probs"] = np.array([[self.logprobs]], dtype=np.int32)
        if self.echo and (self.logprobs is not None or not isinstance(prompt, str)):
            # The prompt's tokens scored in the prefill, returned before the output's; an echoed
            # prompt of token ids takes its text from them.
            inputs["num_prompt_log_probs"] = np.array([[self.logprobs or 0]], dtype=np.int32)
        if self.num_seqs > self.n:  # best_of ranks by the cumulative log-probability
            inputs["return_log_probs"] = np.array([[True]])
        return inputs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name} is not supported: use tools and tool_choice", name)
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")

    def ensemble_inputs(self, index: int = 0) -> dict[str, np.ndarray]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        inputs = self.sampling_inputs(DEFAULT_CHAT_MAX_TOKENS if max_tokens is None else max_tokens, index)
        messages = [_plain_message(m, i) for i, m in enumerate(self.messages)]
        inputs["messages"] = np.array([[json.dumps(messages).encode()]], dtype=object)
        if self.tools:
            inputs["tools"] = np.array([[json.dumps(self.tools).encode()]], dtype=object)
        if self.logprobs:
            inputs["num_top_log_probs"] = np.array([[self.top_logprobs or 0]], dtype=np.int32)
        return inputs

    def tool_inputs(self, inputs: dict[str, np.ndarray], parser: str) -> None:
        """Adds the grammar of the model's tool calls (auto, required or one named function)."""
        if not self.calls_tools:
            return
        try:
            guide = tool_guide(self.tools, self.tool_choice or "auto", parser)
        except Exception as exc:  # xgrammar asserts on what it cannot use, without a message
            logger.info("tool grammar refused: %r", exc)
            raise RequestError("tools cannot be made into a tool-call grammar: check each function's name, "
                               "description and parameters", "tools") from None
        add_guide(inputs, "structural_tag", guide)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def _check_tools(self) -> None:
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise RequestError("tool_choice needs tools", "tool_choice")
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                   f'"parameters": {{...}}}}}}', f"tools[{i}]")
            if not isinstance(function.get("description", ""), str):
                raise RequestError(f"tools[{i}].function.description must be a string",
                                   f"tools[{i}].function.description")
            if not isinstance(function.get("parameters", {}), dict):
                raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                   f"tools[{i}].function.parameters")
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                   '"function": {"name": ...}}', "tool_choice")
            if name not in {t["function"]["name"] for t in self.tools or []}:
                raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        elif choice not in (None, "none", "auto", "required"):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', "tool_choice")
        if self.calls_tools and self.guide() is not None:
            raise RequestError("tools with tool_choice other than none cannot be combined with another output "
                               "constraint", self.guide()[0])

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


def _plain_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as the chat template takes it: text content (parts of type text joined), and
    the tool fields of assistant calls and tool answers (arguments as objects, which tool-aware
    templates write out with tojson)."""
    field = f"messages[{index}]"
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise RequestError(f"{field}.role must be a string", f"{field}.role")
    tool_calls = message.get("tool_calls")
    if role == "assistant" and tool_calls is not None and not isinstance(tool_calls, list):
        raise RequestError(f"{field}.tool_calls must be a list of tool calls", f"{field}.tool_calls")
    if role == "assistant" and tool_calls:
        calls = []
        for j, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"{field}.tool_calls[{j}] must hold a function with a name",
                                   f"{field}.tool_calls[{j}]")
            if not isinstance(call.get("id", ""), (str, type(None))):
                raise RequestError(f"{field}.tool_calls[{j}].id must be a string", f"{field}.tool_calls[{j}].id")
            arguments = function.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
        return {"role": role, "content": content if isinstance(content, str) else None, "tool_calls": calls}
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{field}.content: only text parts are supported", f"{field}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{field}.content must be a string or a list of text parts", f"{field}.content")
    out = {"role": role, "content": content}
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out
