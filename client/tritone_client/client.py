"""Calls the `ensemble` model over gRPC (streaming or not) or HTTP (infer or generate_stream)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

# Input name -> numpy dtype, as the ensemble declares them (TensorRT-LLM's names and dtypes).
INPUT_DTYPES = {
    "max_tokens": np.int32, "end_id": np.int32, "pad_id": np.int32, "top_k": np.int32,
    "min_tokens": np.int32, "min_length": np.int32, "num_top_log_probs": np.int32, "num_prompt_log_probs": np.int32,
    "num_return_sequences": np.int32,
    "top_p": np.float32, "min_p": np.float32, "temperature": np.float32,
    "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32,
    "seed": np.uint64, "random_seed": np.uint64, "lora_task_id": np.uint64,
    "stream": np.bool_, "return_log_probs": np.bool_, "exclude_input_in_output": np.bool_,
    "skip_special_tokens": np.bool_, "apply_chat_template": np.bool_,
    "return_num_input_tokens": np.bool_, "return_num_output_tokens": np.bool_,
    # Guided decoding, as TensorRT-LLM names it: json | json_schema | regex | ebnf_grammar |
    # structural_tag, and the schema, regex, grammar or tag.
    "guided_decoding_guide_type": np.object_, "guided_decoding_guide": np.object_,
}
OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", "cum_log_probs", "output_log_probs", "finish_reason")


@dataclass(slots=True)
class Chunk:
    """One response: the new text when streaming, the whole completion otherwise. The finish
    reason is the engine's: "" while the request runs, then stop, length, cancelled or error."""

    text: str
    num_input_tokens: int
    num_output_tokens: int
    cum_log_prob: float
    output_log_probs: list[float]
    finish_reason: str
    # With num_top_log_probs: for each token, [its text, its log-probability, [[text,
    # log-probability] of the most likely tokens]].
    top_log_probs: list = field(default_factory=list)
    # With num_prompt_log_probs, in the first response: for each prompt token, [its text, its
    # log-probability (None for the first), [[text, log-probability] of the most likely tokens]].
    prompt_log_probs: list = field(default_factory=list)
    # With num_return_sequences above 1: which sequence this response carries.
    sequence_index: int = 0


class TritoneClient:
    def __init__(self, url: str = "127.0.0.1:8001", protocol: str = "grpc", model: str = "ensemble"):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.url, self.protocol, self.model = url, protocol, model
        self._client = None
        if protocol == "grpc":
            import tritonclient.grpc as grpcclient

            self._triton = grpcclient
            self._client = grpcclient.InferenceServerClient(url)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompt: str | list[dict], max_tokens: int = 64, stream: bool = False,
                 stop_words: list[str] | None = None, bad_words: list[str] | None = None,
                 **params) -> Iterator[Chunk]:
        """Yields chunks as they arrive. `prompt` is a text, or chat messages ({"role", "content"}
        dicts) that the server puts in the model's chat template; `params` are any of the
        ensemble's optional inputs."""
        values = {"max_tokens": max_tokens, "stream": stream, **{k: v for k, v in params.items() if v is not None}}
        # The ensemble holds a decoupled model, which Triton serves only over gRPC streams and
        # the HTTP generate endpoints; `stream` says whether the answer comes in pieces.
        if self.protocol == "http":
            yield from self._http_generate(prompt, values, stop_words, bad_words)
        else:
            yield from self._grpc_stream(self._inputs(prompt, values, stop_words, bad_words))

    def complete(self, prompt: str | list[dict], **kwargs) -> Chunk:
        """The whole completion of a non-streamed request."""
        return next(iter(self.generate(prompt, stream=False, **kwargs)))

    def chat(self, messages: list[dict], **kwargs) -> Iterator[Chunk]:
        """The next assistant turn after `messages`, in chunks."""
        return self.generate(list(messages), **kwargs)

    def _inputs(self, prompt, values, stop_words, bad_words):
        t = self._triton
        name, text = _prompt_input(prompt)
        arrays = {name: np.array([[text.encode("utf-8")]], dtype=np.object_)}
        for name, words in (("stop_words", stop_words), ("bad_words", bad_words)):
            if words:
                arrays[name] = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)
        for name, value in values.items():
            if name not in INPUT_DTYPES:
                raise ValueError(f"unknown input {name!r}")
            if INPUT_DTYPES[name] is np.object_:
                value = value.encode("utf-8")
            arrays[name] = np.array([[value]], dtype=INPUT_DTYPES[name])
        return infer_inputs(t, arrays.items())

    def _grpc_stream(self, inputs) -> Iterator[Chunk]:
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            self._client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
            while True:
                result, error = responses.get()
                if error is not None:
                    raise RuntimeError(error.message() if hasattr(error, "message") else str(error))
                response = result.get_response()
                if response.outputs:
                    yield read_grpc_chunk(result)
                if response.parameters["triton_final_response"].bool_param:
                    return
        finally:
            self._client.stop_stream()

    def _http_generate(self, prompt, values, stop_words, bad_words) -> Iterator[Chunk]:
        name, text = _prompt_input(prompt)
        body = {name: text, **values}
        if stop_words:
            body["stop_words"] = stop_words
        if bad_words:
            body["bad_words"] = bad_words
        endpoint = "generate_stream" if values["stream"] else "generate"
        request = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/{endpoint}",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            response = urllib.request.urlopen(request)
        except urllib.error.HTTPError as exc:
            body = exc.read().strip().removeprefix(b"data:")  # generate_stream errors come as an event
            try:
                message = json.loads(body).get("error", str(exc))
            except ValueError:
                message = f"{exc}: {body.decode(errors='replace')}"
            raise RuntimeError(message) from None
        with response:
            if not values["stream"]:
                event = json.loads(response.read())
                yield read_chunk(lambda name: np.array(event[name]) if name in event else None)
                return
            for line in response:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                yield read_chunk(lambda name: np.array(event[name]) if name in event else None)


def _prompt_input(prompt) -> tuple[str, str]:
    """The ensemble input a prompt goes in: text_input, or messages as a JSON string."""
    if isinstance(prompt, str):
        return "text_input", prompt
    return "messages", json.dumps(list(prompt), ensure_ascii=False)


def infer_inputs(triton, tensors) -> list:
    """tritonclient inputs from (name, array) pairs or (name, array, Triton dtype) triples, for
    `triton`: the tritonclient.grpc, tritonclient.grpc.aio or tritonclient.http module. Without a
    dtype, the array's own decides."""
    inputs = []
    for name, array, *dtype in tensors:
        if not dtype:
            dtype = ["BYTES" if array.dtype == np.object_ else _triton_dtype(array.dtype)]
        tensor = triton.InferInput(name, list(array.shape), dtype[0])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _triton_dtype(dtype) -> str:
    return {np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", np.bool_: "BOOL"}[np.dtype(dtype).type]


def read_chunk(get) -> Chunk:
    """One response as a Chunk; `get(name)` is the output's array, or None where the response
    lacks it (a count or a finish reason that only some responses carry reads as 0 or "")."""
    return _chunk(_ArrayFields(get))


def read_grpc_chunk(result) -> Chunk:
    """One gRPC response (tritonclient's InferResult) as a Chunk, read from its raw contents in
    one pass: `as_numpy` scans every output for each name and builds an array for each, which was
    a fifth of the OpenAI front end's Python time per streamed token."""
    response = result.get_response()
    if len(response.raw_output_contents) != len(response.outputs):  # typed contents: the general reader
        return read_chunk(result.as_numpy)
    return _chunk(_RawFields(response))


def _chunk(fields) -> Chunk:
    first = fields.first
    return Chunk(
        text=first("text_output", ""),
        num_input_tokens=int(first("num_input_tokens", 0)),
        num_output_tokens=int(first("num_output_tokens", 0)),
        cum_log_prob=float(first("cum_log_probs", 0.0)),
        output_log_probs=fields.floats("output_log_probs"),
        finish_reason=first("finish_reason", ""),
        top_log_probs=_json_list(first("top_log_probs", "")),
        prompt_log_probs=_json_list(first("prompt_log_probs", "")),
        sequence_index=int(first("sequence_index", 0)),
    )


def _json_list(text: str) -> list:
    return json.loads(text) if text else []


class _ArrayFields:
    """A response's outputs through a getter of arrays (tritonclient's as_numpy, or a JSON event's)."""

    def __init__(self, get):
        self.get = get

    def first(self, name: str, default):
        array = self.get(name)
        if array is None or np.asarray(array).size == 0:
            return default
        value = np.asarray(array).reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value

    def floats(self, name: str) -> list[float]:
        array = self.get(name)
        return [] if array is None else np.asarray(array, dtype=np.float32).reshape(-1).tolist()


class _RawFields:
    """A gRPC response's outputs from its raw contents: Triton's little-endian tensors, BYTES as
    a 4-byte length before each element."""

    def __init__(self, response):
        self.raw = {output.name: (output.datatype, data)
                    for output, data in zip(response.outputs, response.raw_output_contents)}

    def first(self, name: str, default):
        datatype, data = self.raw.get(name, ("", b""))
        if not data:
            return default
        if datatype == "BYTES":
            return data[4:4 + int.from_bytes(data[:4], "little")].decode("utf-8")
        return np.frombuffer(data, dtype=_NUMPY_DTYPES[datatype], count=1)[0].item()

    def floats(self, name: str) -> list[float]:
        datatype, data = self.raw.get(name, ("", b""))
        if not datatype:
            return []
        return np.frombuffer(data, dtype=_NUMPY_DTYPES[datatype]).astype(np.float32).tolist()


_NUMPY_DTYPES = {"BOOL": "?", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
                 "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
                 "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
