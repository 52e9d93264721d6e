"""What Triton hands a model, read and checked without importing Triton: a request's input
tensors (to the engine's types) and the model config's parameters.

The model adapters hand in a getter `get(name) -> np.ndarray | None` for the request's inputs,
so all parsing and validation is tested here; a field that is not valid raises ValueError naming it.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tritone.config import is_set, parameter
from tritone.scheduling.grammar import Guide
from tritone.scheduling.request import SamplingParams
from tritone.text import from_word_list_tensor

Getter = Callable[[str], "np.ndarray | None"]


def triton_getter(pb_utils, request) -> Getter:
    """Reads a Triton request's inputs without the batch dimension (one request per row)."""
    def get(name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()[0]
    return get


# Stop words are matched on every response's text, and bad words ban token sequences at every
# step: a request may not make that work unbounded. The llm model enforces them too: anyone may
# call it directly, past preprocessing.
MAX_WORDS = 256
MAX_WORDS_BYTES = 16384
MAX_BAD_WORD_IDS = 4096
# OpenAI's logit_bias as JSON: at most 300 entries, so a few KiB; room for spaces.
MAX_LOGIT_BIAS_BYTES = 65536
# A structured output's schema, regex or grammar.
MAX_GUIDE_BYTES = 1 << 20
# Sequences of one request (num_return_sequences): each is a request of the engine's.
MAX_RETURN_SEQUENCES = 8

# The server's secret for what only its own parts may ask of the llm model: the ensemble's flow
# control and tritone-openai's aborts. The launcher makes one at every start and hands it to
# tritonserver's and tritone-openai's environments; it never appears in a response.
CONTROL_KEY_ENV = "TRITONE_CONTROL_KEY"


def server_control_key() -> bytes | None:
    key = os.environ.get(CONTROL_KEY_ENV)
    return key.encode() if key else None


def _is_control_key(get: Getter, server_key: bytes | None) -> bool:
    """Whether the request carries the server's control key (False when it carries none);
    a wrong one is refused, naming the field."""
    given = get("CONTROL_KEY")
    if given is None:
        return False
    if server_key is None:  # a server started without the launcher: the ensemble's own word
        return True
    value = given.reshape(-1)[0] if given.size else b""
    value = value if isinstance(value, (bytes, np.bytes_)) else str(value).encode()
    if not secrets.compare_digest(bytes(value), server_key):
        raise ValueError("control_key is not this server's: control inputs are for the server's own models")
    return True


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
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                raise ValueError(f'messages[{i}].tool_calls[{j}] must be {{"function": {{"name": ..., "arguments": ...}}}}')
    check_strings(messages, "messages")
    return messages


def check_strings(value, name: str) -> None:
    """Refuses a string that has no UTF-8 form, naming where it is: JSON may spell a lone
    surrogate ("\\ud800"), which parses, then fails the tokenizer for every request batched with it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} is not valid UTF-8 (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_strings(key, name)
            check_strings(item, f"{name}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{name}[{i}]")


def parse_tools(raw, max_bytes: int = 0) -> list[dict]:
    """The `tools` input: a JSON list of OpenAI function tools, as chat templates take them."""
    tools = _json_input(raw, "tools", max_bytes)
    if not isinstance(tools, list):
        raise ValueError('tools must be a JSON list of {"type": "function", "function": {...}} objects')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    check_strings(tools, "tools")
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
    # TensorRT-LLM's num_return_sequences: sequences of the prompt, each its own engine request
    # (sequence i draws from seed + i), each response naming its sequence_index.
    num_return_sequences: int = 1


def parse_llm_request(get: Getter, server_key: bytes | None = None) -> LLMRequest:
    """Reads the `llm` model's inputs; raises ValueError naming the field. `server_key`: the
    server's control key, which the ensemble's requests carry (flow control)."""
    flow_control = _is_control_key(get, server_key)
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
        logit_bias=parse_logit_bias(get),
        num_top_log_probs=None if get("NUM_TOP_LOG_PROBS") is None else int(scalar(get, "NUM_TOP_LOG_PROBS")),
        prompt_log_probs=None if get("NUM_PROMPT_LOG_PROBS") is None else int(scalar(get, "NUM_PROMPT_LOG_PROBS")),
        lora_id=int(scalar(get, "LORA_TASK_ID", 0)),
        guide=parse_guide(get),
    )
    num_sequences = int(scalar(get, "NUM_RETURN_SEQUENCES", 1))
    if not 1 <= num_sequences <= MAX_RETURN_SEQUENCES:
        raise ValueError(f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {num_sequences}")
    return LLMRequest(
        num_return_sequences=num_sequences,
        prompt_ids=input_ids.reshape(-1).tolist(),
        params=params,
        stream=bool(scalar(get, "STREAM", False)),
        exclude_input_in_output=bool(scalar(get, "EXCLUDE_INPUT_IN_OUTPUT", True)),
        skip_special_tokens=bool(scalar(get, "SKIP_SPECIAL_TOKENS", True)),
        stop_words=text_list(get, "STOP_WORDS"),
        flow_control=flow_control,
    )


def parse_logit_bias(get: Getter) -> dict[int, float]:
    """The `logit_bias` input: a JSON object of token id (a decimal string, as OpenAI's keys are)
    -> bias. Its range and the ids' vocabulary are checked with the other sampling parameters."""
    raw = get("LOGIT_BIAS")
    if raw is None:
        return {}
    if raw.size != 1:
        raise ValueError(f"logit_bias must hold exactly one value, got shape {list(raw.shape)}")
    bias = _json_input(raw.reshape(-1)[0], "logit_bias", MAX_LOGIT_BIAS_BYTES)
    if not isinstance(bias, dict):
        raise ValueError('logit_bias must be a JSON object of token id -> bias, such as {"50256": -100}')
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise ValueError(f"logit_bias must map token ids to numbers, got {key!r}: {value!r}")
        parsed[int(key)] = float(value)
    return parsed


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
    if guide is not None and len(guide) > MAX_GUIDE_BYTES:
        raise ValueError(f"guided_decoding_guide is {len(guide)} characters long, over the limit of {MAX_GUIDE_BYTES}")
    return Guide(str(guide_type), "" if guide is None else str(guide))


def abort_target(get: Getter, server_key: bytes | None) -> str | None:
    """A control request's target, the Triton request id whose requests to stop; None for a
    generation request. Only the server's own parts may send one: ids are the clients' to
    choose ("0", "1", ...), so without the key anyone could stop anyone's requests."""
    request_id = get("ABORT_REQUEST_ID")
    if request_id is None:
        return None
    if server_key is None or get("CONTROL_KEY") is None:
        raise ValueError("abort_request_id needs the server's control_key: control requests are for the "
                         "server's own front end")
    _is_control_key(get, server_key)
    return decode_text(request_id.reshape(-1)[0], "abort_request_id")


def _word_ids(get: Getter, name: str) -> list[list[int]]:
    array = get(name)
    if array is None:
        return []
    if array.ndim != 2 or array.shape[0] != 2:
        raise ValueError(f"{name.lower()} must have shape [2, N] (ids, then offsets), got {list(array.shape)}")
    if array.shape[1] > MAX_BAD_WORD_IDS:
        raise ValueError(f"{name.lower()} holds {array.shape[1]} ids, over the limit of {MAX_BAD_WORD_IDS}")
    words = from_word_list_tensor(array)
    if len(words) > MAX_WORDS:
        raise ValueError(f"{name.lower()} holds {len(words)} sequences, over the limit of {MAX_WORDS}")
    return words


def model_parameters(model_config: dict) -> dict[str, str]:
    """A Triton model config's `parameters` as plain strings."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def flow_board_path(params: dict[str, str]) -> str | None:
    """The `flow_board` parameter: the page's path in the launcher's private directory (None:
    the default, named after tritonserver's pid)."""
    path = params.get("flow_board")
    return path if is_set(path) else None


def stream_interval(params: dict[str, str]) -> int:
    """The `stream_interval` parameter: tokens per streamed response."""
    return parameter(params, "stream_interval")
