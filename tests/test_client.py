"""The client library's reading of the ensemble's responses: the raw gRPC reader that tritone-openai
uses per streamed token gives what tritonclient's own arrays give."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from tritone_client.client import read_chunk, read_grpc_chunk


def grpc_result(arrays: dict[str, np.ndarray]) -> InferResult:
    """A tritonclient gRPC result of these outputs, in raw contents as tritonserver sends them."""
    response = service_pb2.ModelInferResponse()
    for name, array in arrays.items():
        response.outputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        if array.dtype != object:
            response.raw_output_contents.append(array.tobytes())
        else:  # an empty BYTES tensor serializes to no bytes at all
            response.raw_output_contents.append(serialize_byte_tensor(array).item() if array.size else b"")
    return InferResult(response)


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


floats = st.floats(-1e4, 0.0, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.text(), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1), st.lists(floats, max_size=5),
       st.sampled_from(["", "stop", "length"]), st.booleans(), st.booleans())
def test_raw_reader_equals_tritonclients(text_output, num_input, num_output, log_probs, reason, with_counts, with_extras):
    arrays = {"text_output": text(text_output), "num_output_tokens": np.array([num_output], np.int32)}
    if with_counts:
        arrays["num_input_tokens"] = np.array([num_input], np.int32)
    if reason:
        arrays["finish_reason"] = text(reason)
    if with_extras:
        arrays["cum_log_probs"] = np.array([sum(log_probs)], np.float32)
        arrays["output_log_probs"] = np.array(log_probs, np.float32)
        arrays["top_log_probs"] = text('[["a", -0.5, [["a", -0.5]]]]')
        arrays["sequence_index"] = np.array([3], np.int32)
    result = grpc_result(arrays)
    fast, general = read_grpc_chunk(result), read_chunk(result.as_numpy)
    assert fast == general
    assert fast.text == text_output and fast.num_output_tokens == num_output
    assert fast.num_input_tokens == (num_input if with_counts else 0) and fast.finish_reason == reason
    if with_extras:
        assert fast.output_log_probs == np.array(log_probs, np.float32).tolist() and fast.sequence_index == 3
        assert math.isclose(fast.cum_log_prob, float(np.float32(sum(log_probs))), rel_tol=1e-6)


def test_empty_outputs_read_as_absent():
    """A response may carry an output with no elements (an empty text, no log probabilities)."""
    result = grpc_result({"text_output": np.array([], dtype=object), "output_log_probs": np.zeros(0, np.float32),
                          "num_output_tokens": np.array([0], np.int32)})
    chunk = read_grpc_chunk(result)
    assert chunk == read_chunk(result.as_numpy)
    assert (chunk.text, chunk.output_log_probs, chunk.finish_reason) == ("", [], "")


def test_typed_contents_fall_back_to_tritonclients_reader():
    """Where a server sends contents in typed fields instead of raw bytes, they are still read."""
    response = service_pb2.ModelInferResponse()
    output = response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    output.contents.bytes_contents.append("Paris".encode())
    assert read_grpc_chunk(InferResult(response)).text == "Paris"
