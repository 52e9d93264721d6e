"""OpenAI's request bodies, checked, and what each becomes as `ensemble` inputs.

Only what the engine can honour is accepted: an unsupported feature (n > 1, tools, echo, ...)
is refused with a 400 that names it, and an unknown field is refused too, never ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# When a request sets no max_tokens: OpenAI's documented default for completions; for chat,
# where OpenAI runs to the end of the context, a bound that fits any prompt of the default model.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024


class RequestError(Exception):
    """A request the front end refuses: HTTP `status`, OpenAI error `type`, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: usage so far in every chunk (the throughput script counts tokens by it).
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields common to completions and chat, with vLLM's extras that benchmark tools send."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # metadata only
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise RequestError("n must be 1: one choice per request is supported", "n")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")

    def sampling_inputs(self, max_tokens: int) -> dict[str, np.ndarray]:
        """The ensemble's sampling inputs. OpenAI samples at temperature 1 when none is given
        (the ensemble alone would decode greedily, as TensorRT-LLM does)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        values = {
            "max_tokens": (max_tokens, np.int32),
            "temperature": (1.0 if self.temperature is None else self.temperature, np.float32),
            "top_p": (self.top_p, np.float32), "top_k": (self.top_k, np.int32), "min_p": (self.min_p, np.float32),
            "presence_penalty": (self.presence_penalty, np.float32),
            "frequency_penalty": (self.frequency_penalty, np.float32),
            "repetition_penalty": (self.repetition_penalty, np.float32),
            "min_tokens": (self.min_tokens, np.int32), "seed": (self.seed, np.uint64),
            "end_id": (-1 if self.ignore_eos else None, np.int32),
            "stream": (self.stream, np.bool_),
        }
        inputs = {name: np.array([[value]], dtype=dtype) for name, (value, dtype) in values.items() if value is not None}
        if stop:
            inputs["stop_words"] = np.array([[s.encode() for s in stop]], dtype=object)
        return inputs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise RequestError("prompt must be one string: batches of prompts are not supported", "prompt")
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise RequestError("best_of must be 1", "best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.logprobs is not None and self.logprobs > 1:
            raise RequestError("logprobs may be 0 or 1: only the chosen tokens' log-probabilities are returned",
                               "logprobs")

    def ensemble_inputs(self) -> dict[str, np.ndarray]:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        inputs = self.sampling_inputs(DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens)
        # A completion continues the text as it is: no chat template.
        inputs["text_input"] = np.array([[prompt.encode()]], dtype=object)
        inputs["apply_chat_template"] = np.array([[False]])
        if self.logprobs is not None:
            inputs["return_log_probs"] = np.array([[True]])
        return inputs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise RequestError(f"{name} is not supported: tool and function calling are not implemented", name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestError("response_format must be {\"type\": \"text\"}: structured output is not supported",
                               "response_format")
        if self.top_logprobs:
            raise RequestError("top_logprobs is not supported: only the chosen tokens' log-probabilities are returned",
                               "top_logprobs")

    def ensemble_inputs(self) -> dict[str, np.ndarray]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        inputs = self.sampling_inputs(DEFAULT_CHAT_MAX_TOKENS if max_tokens is None else max_tokens)
        messages = [_plain_message(m, i) for i, m in enumerate(self.messages)]
        inputs["messages"] = np.array([[json.dumps(messages).encode()]], dtype=object)
        if self.logprobs:
            inputs["return_log_probs"] = np.array([[True]])
        return inputs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


def _plain_message(message: dict[str, Any], index: int) -> dict[str, str]:
    """A message as the chat template takes it: text content only (parts of type text joined)."""
    field = f"messages[{index}]"
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise RequestError(f"{field}.role must be a string", f"{field}.role")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{field}.content: only text parts are supported", f"{field}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{field}.content must be a string or a list of text parts", f"{field}.content")
    return {"role": role, "content": content}


FinishReason = Literal["stop", "length"]


def finish_reason(engine_reason: str) -> str | None:
    """OpenAI's finish reason for the ensemble's (empty while the request runs)."""
    return {"": None, "stop": "stop", "length": "length"}.get(engine_reason, engine_reason)
