"""Between Triton tensors and the engine's types, without importing Triton.

The model adapters hand in a getter `get(name) -> np.ndarray | None` for the request's inputs
and send the dicts of arrays returned here, so all parsing and validation is tested here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np

from tritone.flow import ChunkWatch, FlowBoard
from tritone.grammar import Guide
from tritone.request import FinishReason, RequestOutput, SamplingParams
from tritone.text import Detokenizer, StopMatcher, from_word_list_tensor

Getter = Callable[[str], "np.ndarray | None"]

# Stop words are matched on every response's text, and bad words ban token sequences at every
# step: a request may not make that work unbounded.
MAX_WORDS = 256
MAX_WORDS_BYTES = 16384
# Prompt text is tokenized before its token count can be checked; this bounds that work.
DEFAULT_MAX_INPUT_BYTES = 1 << 20


def scalar(get: Getter, name: str, default=None):
    """The single value of an optional input, or `default` when the request leaves it out."""
    array = get(name)
    if array is None:
        return default
    if array.size != 1:
        raise ValueError(f"{name.lower()} must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8")
    return value.item() if hasattr(value, "item") else value


def text_list(get: Getter, name: str) -> list[str]:
    """An optional list of strings (stop words, bad words), UTF-8 checked."""
    array = get(name)
    if array is None:
        return []
    items = array.reshape(-1).tolist()
    if len(items) > MAX_WORDS:
        raise ValueError(f"{name.lower()} holds {len(items)} words, over the limit of {MAX_WORDS}")
    if sum(len(item) for item in items) > MAX_WORDS_BYTES:
        raise ValueError(f"{name.lower()} holds more than {MAX_WORDS_BYTES} bytes in all")
    words = []
    for item in items:
        try:
            word = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError:
            raise ValueError(f"{name.lower()} holds bytes that are not valid UTF-8") from None
        if word == "":
            raise ValueError(f"{name.lower()} holds an empty string")
        words.append(word)
    return words


def decode_text(raw, name: str = "text_input", max_bytes: int = 0) -> str:
    if max_bytes and len(raw) > max_bytes:
        raise ValueError(f"{name} is {len(raw)} bytes long, over the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw)
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not valid UTF-8") from None
    if not text:
        raise ValueError(f"{name} is empty")
    return text


def parse_messages(raw, max_bytes: int = 0) -> list[dict]:
    """Chat messages from the `messages` input: a JSON list of {"role": ..., "content": ...}; an
    assistant message may hold `tool_calls` instead of content, and a tool's answer its
    `tool_call_id` (OpenAI's shapes, which tool-aware chat templates read)."""
    messages = _json_input(raw, "messages", max_bytes)
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty JSON list of {"role": ..., "content": ...} objects')
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise ValueError(f"messages[{i}] must be an object with a string role and a string content")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{i}] must be an object with a string role and a string content")
        if "tool_calls" in message and not isinstance(message["tool_calls"], list):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
    return messages


def parse_tools(raw, max_bytes: int = 0) -> list[dict]:
    """The `tools` input: a JSON list of OpenAI function tools, as chat templates take them."""
    tools = _json_input(raw, "tools", max_bytes)
    if not isinstance(tools, list):
        raise ValueError('tools must be a JSON list of {"type": "function", "function": {...}} objects')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return tools


def _json_input(raw, name: str, max_bytes: int):
    text = decode_text(raw, name, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None


@dataclass(slots=True)
class LLMRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    skip_special_tokens: bool
    # Matched on the generated text by ResponseStream; the engine knows nothing of them.
    stop_words: list[str] = field(default_factory=list)
    # Postprocessing marks the chunks on the flow board (a stream of the ensemble).
    flow_control: bool = False


def parse_llm_request(get: Getter) -> LLMRequest:
    """Reads the `llm` model's inputs; raises ValueError naming the field."""
    input_ids = get("INPUT_IDS")
    if input_ids is None:
        raise ValueError("input_ids is missing")
    max_tokens = scalar(get, "MAX_TOKENS")
    if max_tokens is None:
        raise ValueError("max_tokens is missing")
    temperature = scalar(get, "TEMPERATURE")
    top_k = scalar(get, "TOP_K", 0)
    top_p = scalar(get, "TOP_P", 1.0)
    if temperature is None:
        # As in TensorRT-LLM: a request that sets no sampling input is decoded greedily.
        temperature = 1.0 if get("TOP_K") is not None or get("TOP_P") is not None else 0.0
    seed = scalar(get, "SEED", scalar(get, "RANDOM_SEED"))
    params = SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        min_p=float(scalar(get, "MIN_P", 0.0)),
        repetition_penalty=float(scalar(get, "REPETITION_PENALTY", 1.0)),
        presence_penalty=float(scalar(get, "PRESENCE_PENALTY", 0.0)),
        frequency_penalty=float(scalar(get, "FREQUENCY_PENALTY", 0.0)),
        min_tokens=int(scalar(get, "MIN_TOKENS", scalar(get, "MIN_LENGTH", 0))),
        end_id=None if get("END_ID") is None else int(scalar(get, "END_ID")),
        seed=None if seed is None else int(seed),
        bad_token_ids=_word_ids(get, "BAD_WORDS_IDS"),
        return_log_probs=bool(scalar(get, "RETURN_LOG_PROBS", False)),
        guide=parse_guide(get),
    )
    return LLMRequest(
        prompt_ids=input_ids.reshape(-1).tolist(),
        params=params,
        stream=bool(scalar(get, "STREAM", False)),
        exclude_input_in_output=bool(scalar(get, "EXCLUDE_INPUT_IN_OUTPUT", True)),
        skip_special_tokens=bool(scalar(get, "SKIP_SPECIAL_TOKENS", True)),
        stop_words=text_list(get, "STOP_WORDS"),
        flow_control=bool(scalar(get, "FLOW_CONTROL", False)),
    )


def parse_guide(get: Getter) -> Guide | None:
    """TensorRT-LLM's guided decoding inputs: guided_decoding_guide_type (json, json_schema,
    regex, ebnf_grammar, structural_tag) and guided_decoding_guide (the schema, regex, grammar or
    tag; none for json). The guide is checked when the engine takes the request."""
    guide_type = scalar(get, "GUIDED_DECODING_GUIDE_TYPE")
    guide = scalar(get, "GUIDED_DECODING_GUIDE")
    if guide_type is None:
        if guide is not None:
            raise ValueError("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    return Guide(str(guide_type), "" if guide is None else str(guide))


def abort_target(get: Getter) -> tuple[int | None, str | None] | None:
    """A control request's target: (engine key, None) or (None, Triton request id); None for a
    generation request."""
    key, request_id = get("ABORT_KEY"), get("ABORT_REQUEST_ID")
    if key is not None:
        return int(key.reshape(-1)[0]), None
    if request_id is not None:
        return None, decode_text(request_id.reshape(-1)[0], "abort_request_id")
    return None


def _word_ids(get: Getter, name: str) -> list[list[int]]:
    array = get(name)
    return [] if array is None else from_word_list_tensor(array)


# finish_reason codes in STATE: 0 while the request runs.
FINISH_REASONS = ("",) + tuple(reason.value for reason in FinishReason)


class ResponseState(NamedTuple):
    """An llm response's scalars, packed into one int64 tensor `STATE` in this order and followed
    by the ids of the chunk's decoding context (its log probabilities, when asked for, go into
    one float32 tensor `LOG_PROBS`, the cumulative one first): every tensor is work for the Python
    backend, tritonserver and postprocessing, once per response."""

    is_final: bool
    skip_special_tokens: bool
    num_dropped_chars: int
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str
    request_key: int
    # The stream's chunk number, and the chunk's place among every stream's chunks in the order
    # they were sent: what postprocessing marks on the flow board (tritone.flow).
    chunk_seq: int
    send_seq: int

    @classmethod
    def read(cls, state: np.ndarray) -> "ResponseState":
        v = state.reshape(-1)[:len(cls._fields)].tolist()
        return cls(bool(v[0]), bool(v[1]), v[2], v[3], v[4], FINISH_REASONS[v[5]], *v[6:])

    @classmethod
    def context_ids(cls, state: np.ndarray) -> list[int]:
        return state.reshape(-1)[len(cls._fields):].tolist()

    def tensor(self, context_ids: list[int] = ()) -> np.ndarray:
        return np.array([*self._replace(finish_reason=FINISH_REASONS.index(self.finish_reason)), *context_ids],
                        dtype=np.int64)


@dataclass(slots=True)
class ResponseStream:
    """One request's output side in the `llm` model: turns engine outputs into responses.

    It runs in the engine's sender thread. Every response carries the ids not sent before and
    the context a stateless postprocessing needs to decode them. With stop words it also decodes
    the ids itself, holds back those whose text could begin a stop word, and on a match sends the
    final response early (the caller then aborts the engine's request with reason "stop"). With a
    flow board (a stream of the ensemble), a chunk waits while the last one has not reached
    postprocessing: its tokens go out with the next one (tritone.flow).
    """

    request: LLMRequest
    detokenizer: Detokenizer
    # A streamed response carries at least this many new tokens, except the first and the final
    # one: fewer responses, each with more text (vLLM's --stream-interval).
    stream_interval: int = 1
    # The engine's key of the request, which postprocessing hands back to abort it.
    key: int = 0
    # Ids the client sees: the prompt first when it asked for it, then the generated ids.
    ids: list[int] = field(default_factory=list)
    num_prompt_ids: int = 0
    log_probs: list[float] = field(default_factory=list)
    num_sent: int = 0
    stop: StopMatcher | None = None
    is_finished: bool = False
    flow: FlowBoard | None = None
    # Numbers every chunk of every stream in the order sent (one counter for the llm model).
    sends: Iterator[int] = field(default_factory=itertools.count)
    # The last chunk sent, until the stream's final one.
    in_flight: ChunkWatch | None = None

    def __post_init__(self):
        if not self.request.exclude_input_in_output:
            self.ids.extend(self.request.prompt_ids)
            self.num_prompt_ids = len(self.ids)
        if self.request.stop_words:
            self.stop = StopMatcher(self.detokenizer, self.request.stop_words, self.request.skip_special_tokens,
                                    self.ids)

    def on_output(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        """The response tensors for this output (which may carry several new tokens), or None
        while there is nothing to send; None for anything after the final response."""
        if self.is_finished:
            return None
        self.ids.extend(output.new_token_ids)
        self.log_probs.extend(output.new_log_probs)
        end, num_dropped, reason = len(self.ids), 0, output.finish_reason
        if self.stop is not None:
            stop_start = self.stop.feed(self.ids, output.finished)
            if stop_start is not None:
                end, num_dropped = self.stop.cut(self.ids, stop_start, self.num_sent)
                reason = FinishReason.STOP
            elif not output.finished:
                end = self.stop.num_safe_ids()
        final = output.finished or reason == FinishReason.STOP
        if not final and (not self.request.stream or end == self.num_sent
                          or (self.num_sent > self.num_prompt_ids and end - self.num_sent < self.stream_interval)
                          or self.is_held()):
            return None
        return self._response(end, final, reason, num_dropped)

    def is_held(self) -> bool:
        """Whether the last chunk is still on its way to postprocessing."""
        watch = self.in_flight
        return watch is not None and not self.flow.is_received(watch.key, watch.seq)

    def _response(self, end: int, final: bool, reason: FinishReason | None,
                  num_dropped: int) -> dict[str, np.ndarray]:
        skip = self.request.skip_special_tokens
        context = self.detokenizer.context(self.ids, self.num_sent, skip)
        new_ids = self.ids[self.num_sent:end]
        first, last = max(0, self.num_sent - self.num_prompt_ids), end - self.num_prompt_ids
        self.num_sent, self.is_finished = end, final
        seq, sent = (self.in_flight.seq + 1 if self.in_flight else 1), next(self.sends)
        self.in_flight = None if final or self.flow is None else ChunkWatch(self.key, seq, sent, time.monotonic_ns())
        # num_output_tokens: generated tokens sent so far; after a stop word, up to the one where it starts.
        state = ResponseState(final, skip, num_dropped, len(self.request.prompt_ids), last,
                              reason.value if final and reason else "", self.key, seq, sent)
        tensors = {"TOKEN_IDS": np.array(new_ids, dtype=np.int32), "STATE": state.tensor(context)}
        if self.request.params.return_log_probs:
            tensors["LOG_PROBS"] = np.array([sum(self.log_probs[:last])] + self.log_probs[first:last], dtype=np.float32)
        return tensors


def error_message(output: RequestOutput) -> str | None:
    if output.finish_reason == FinishReason.ERROR:
        return output.error or "request failed"
    return None


def model_parameters(model_config: dict) -> dict[str, str]:
    """A Triton model config's `parameters` as plain strings."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def is_set(value: str | None) -> bool:
    """An unfilled `${template}` or empty parameter counts as unset."""
    return bool(value) and not value.startswith("${")


def stream_interval(params: dict[str, str]) -> int:
    """The `stream_interval` parameter: tokens per streamed response (default 1)."""
    raw = params.get("stream_interval")
    value = int(raw) if is_set(raw) else 1
    if value < 1:
        raise ValueError(f"stream_interval must be at least 1, got {value}")
    return value


class Preprocessor:
    """The `preprocessing` model's work for a batch of requests: one tokenizer call for all."""

    def __init__(self, params: dict[str, str]):
        from tritone.text import PromptEncoder

        chat = params.get("chat_template")
        self.encoder = PromptEncoder(params["model_dir"], chat if is_set(chat) else "auto")
        limit = params.get("max_input_len")
        model_limit = params.get("max_model_len")
        self.max_input_len = int(limit) if is_set(limit) and int(limit) > 0 else (
            int(model_limit) if is_set(model_limit) and int(model_limit) > 0 else _model_context(params["model_dir"]))
        max_bytes = params.get("max_input_bytes")
        self.max_input_bytes = int(max_bytes) if is_set(max_bytes) else DEFAULT_MAX_INPUT_BYTES

    def __call__(self, getters: list[Getter]) -> list["dict[str, np.ndarray] | ValueError"]:
        from tritone.text import to_word_list_tensor

        results: list = [None] * len(getters)
        prepared, index = [], []
        for i, get in enumerate(getters):
            try:
                name, prompt = self._prompt(get)
                flag = scalar(get, "APPLY_CHAT_TEMPLATE")
                tools = get("TOOLS")
                tools = None if tools is None else parse_tools(tools.reshape(-1)[0], self.max_input_bytes)
                text = self.encoder.prepare(prompt, None if flag is None else bool(flag), tools)
                bad_words = self.encoder.encode_bad_words(text_list(get, "BAD_WORDS"))
            except ValueError as exc:
                results[i] = exc
                continue
            results[i] = {"BAD_WORDS_IDS": to_word_list_tensor(bad_words)}
            prepared.append(text)
            index.append((i, name))
        for (i, name), ids in zip(index, self.encoder.tokenize(prepared) if prepared else []):
            if self.max_input_len and len(ids) > self.max_input_len:
                results[i] = ValueError(f"{name} is {len(ids)} tokens long, over the limit of "
                                        f"{self.max_input_len} tokens")
            else:
                results[i]["INPUT_IDS"] = np.array(ids, dtype=np.int32)
        return results

    def _prompt(self, get: Getter) -> tuple[str, str | list[dict]]:
        text, messages = get("TEXT_INPUT"), get("MESSAGES")
        if text is not None and messages is not None:
            raise ValueError("give either text_input or messages, not both")
        if messages is not None:
            return "messages", parse_messages(messages.reshape(-1)[0], self.max_input_bytes)
        if text is None:
            raise ValueError("text_input is missing (or send chat messages as messages)")
        return "text_input", decode_text(text.reshape(-1)[0], max_bytes=self.max_input_bytes)


def _model_context(model_dir: str) -> int:
    """The model's own context length, so that an over-long prompt fails here, naming its field."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir).get_text_config()
    except (OSError, ValueError):
        return 0
    return int(getattr(config, "max_position_embeddings", 0) or 0)


class Postprocessor:
    """The `postprocessing` model's work: text deltas for a batch of llm responses."""

    def __init__(self, detokenizer: Detokenizer, flow: FlowBoard | None = None):
        self.detokenizer, self.flow = detokenizer, flow

    @classmethod
    def from_parameters(cls, params: dict[str, str], flow: FlowBoard | None = None) -> "Postprocessor":
        from tritone.text import load_tokenizer

        return cls(Detokenizer(load_tokenizer(params["model_dir"])), flow)

    def __call__(self, getters: list[Getter]) -> list[dict[str, np.ndarray]]:
        raw = [get("STATE") for get in getters]
        states = [ResponseState.read(r) for r in raw]
        if self.flow is not None:  # first of all: the llm model holds these streams until then
            self.flow.received([(s.request_key, s.chunk_seq, s.send_seq) for s in states])
        try:
            return [self._one(get, state, ResponseState.context_ids(r)) for get, state, r in zip(getters, states, raw)]
        finally:
            if self.flow is not None:
                self.flow.done()

    def _one(self, get: Getter, state: ResponseState, context_ids: list[int]) -> dict[str, np.ndarray]:
        # Every output tensor is work for this process and tritonserver on every response: the
        # prompt's count comes with the first and the final one, the finish reason with the final.
        new_ids = get("TOKEN_IDS").tolist()
        result = {
            "TEXT_OUTPUT": np.array([self.text(new_ids, context_ids, state).encode()], np.object_),
            "OUT_NUM_OUTPUT_TOKENS": np.array([state.num_output_tokens], dtype=np.int32),
        }
        if state.is_final or state.num_output_tokens <= len(new_ids):  # all so far: the first
            result["OUT_NUM_INPUT_TOKENS"] = np.array([state.num_input_tokens], dtype=np.int32)
        if state.is_final:
            result["OUT_FINISH_REASON"] = np.array([state.finish_reason.encode()], dtype=np.object_)
        log_probs = get("LOG_PROBS")
        if log_probs is not None:  # only for requests that asked for them
            result["OUT_CUM_LOG_PROBS"] = log_probs[:1]
            result["OUT_OUTPUT_LOG_PROBS"] = log_probs[1:]
        return result

    def text(self, new_ids: list[int], context_ids: list[int], state: ResponseState) -> str:
        text = self.detokenizer.delta(context_ids, new_ids, is_final=state.is_final,
                                      skip_special_tokens=state.skip_special_tokens)
        # A stop word begins inside this chunk's text: it ends right before it.
        return text[:max(0, len(text) - state.num_dropped_chars)]


def triton_getter(pb_utils, request) -> Getter:
    """Reads a Triton request's inputs without the batch dimension (one request per row)."""
    def get(name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()[0]
    return get


# Every `poll` seconds: ends when the process $2 is gone, kills it once its parent is no longer
# $1 (tritonserver died and it was re-parented).
_ORPHAN_WATCH = """
while [ -d /proc/$2 ]; do
  [ "$(cut -d' ' -f4 /proc/$2/stat)" = "$1" ] || { kill -9 $2; exit 0; }
  sleep $3
done
"""


def exit_when_orphaned(poll_seconds: float = 1.0) -> None:
    """Ends this model process as soon as tritonserver, its parent, is gone.

    The Python backend's stub is meant to exit when the server dies, but an engine process has
    been seen to outlive a killed server, keeping its memory and a core. A thread of its own
    is not enough: the stub was found with every thread waiting on a lock, the interpreter's
    lock held by one blocked on the dead server's shared memory. So a small shell process,
    which needs nothing from this one, watches instead."""
    subprocess.Popen(["/bin/sh", "-c", _ORPHAN_WATCH, "tritone-orphan-watch", str(os.getppid()), str(os.getpid()),
                      str(poll_seconds)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)


def end_process(message: str) -> None:
    """The engine died (see AsyncEngine): ends this model's process, once its requests have been
    failed, so that the launcher restarts the server as for any dead model process. A model that
    stayed up would accept requests it can never answer, and Triton 2.51's Python backend has no
    way to report one model instance not ready."""
    logging.getLogger("tritone").critical("%s: ending the model process", message)
    logging.shutdown()
    os._exit(1)


SHUTTING_DOWN = "server is shutting down: request not accepted"


class Drain:
    """Graceful shutdown across Tritone's processes, signalled by files the launcher owns.

    Triton 2.51 stops every model's scheduler as soon as it is told to exit, so an ensemble
    request whose llm step is still streaming can no longer reach postprocessing: its step fails
    to enqueue, the ensemble never answers, and the server waits out its exit timeout. So the
    launcher drains before it signals tritonserver: it creates `path`; from then on the entry
    model (preprocessing, or llm_inline) refuses new requests, the engine finishes those it
    holds, and once it has held none for `quiet_seconds` it creates `path`.done."""

    def __init__(self, path: str | None, quiet_seconds: float = 0.3, poll_seconds: float = 0.05):
        self.path = path if is_set(path) else None
        self.quiet_seconds, self.poll_seconds = quiet_seconds, poll_seconds

    @property
    def done_path(self) -> str:
        return f"{self.path}.done"

    def requested(self) -> bool:
        # One stat per batch of requests: cheaper than any message from the launcher.
        return self.path is not None and os.path.exists(self.path)

    def watch(self, is_idle: Callable[[], bool], stopping: threading.Event) -> None:
        """In a thread: once a drain is asked for, reports the engine idle. The quiet period
        covers a request between preprocessing and the engine, seen by neither."""
        if self.path is None:
            return

        def run():
            idle_since = None
            while not stopping.wait(self.poll_seconds):
                if not (self.requested() and is_idle()):
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.quiet_seconds:
                    open(self.done_path, "w").close()
                    return

        threading.Thread(target=run, name="tritone-drain", daemon=True).start()
