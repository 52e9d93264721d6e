"""Bad input, cancellation, overload, a dead model process and shutdown, against a real tritonserver.

The first tests use the session's server; the rest share one small server (a KV cache of a few
blocks and a queue limit) whose llm process gets killed, and which the last test shuts down.
"""

import json
import os
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import PROMPTS, open_http_generate_stream, supervised_server
from test_integration import grpc_inputs, metric_values, post

pytestmark = pytest.mark.integration

QUESTION = "The capital of France is"
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 16  # SmolLM2-135M, fp32: layers * kv heads * head dim * (k, v) * 4 B * 16 tokens


def ensemble_inputs(prompt=QUESTION, num_tokens=4, **extra):
    """Ensemble inputs; `extra` values are (array, Triton dtype) pairs, or None to leave one out."""
    tensors = {"text_input": (np.array([[prompt.encode()]], dtype=object), "BYTES"),
               "max_tokens": (np.array([[num_tokens]], dtype=np.int32), "INT32"),
               "apply_chat_template": (np.array([[False]]), "BOOL")}
    tensors.update(extra)
    return grpc_inputs(*[(name, *value) for name, value in tensors.items() if value is not None])


class Stream:
    """One gRPC stream carrying many requests: texts and finish reasons by request id, and errors."""

    def __init__(self, url):
        self.client = grpcclient.InferenceServerClient(url)
        self.texts, self.finish, self.errors = {}, {}, []
        self.lock = threading.Lock()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        with self.lock:
            if error is not None:
                self.errors.append(str(error))
                return
            request_id = result.get_response().id
            self.texts.setdefault(request_id, []).append(result.as_numpy("text_output").reshape(-1)[0].decode())
            reason = result.as_numpy("finish_reason")  # the final response's
            if reason is not None:
                self.finish[request_id] = reason.reshape(-1)[0].decode()

    def send(self, inputs, request_id=""):
        self.client.async_stream_infer("ensemble", inputs, request_id=request_id)

    def text(self, request_id):
        return "".join(self.texts.get(request_id, []))

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def one_request(url, inputs):
    """(text, None) or (None, error message) for one non-streamed request on its own stream."""
    stream = Stream(url)
    stream.send(inputs, "0")
    stream.close()
    if stream.errors:
        return None, stream.errors[0]
    return stream.text("0"), None


def wait_until_idle(server, timeout=120.0):
    """The engine's metrics once it holds no request and no KV block (reported once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(server)
        idle = values["tritone_kv_blocks_used"] == 0 and values["tritone_num_requests_running"] == 0 \
            and values["tritone_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def grpc_url(server):
    return f"{server.args.host}:{server.args.grpc_port}"


def f32(x):
    return np.array([[x]], dtype=np.float32), "FP32"


def i32(x):
    return np.array([[x]], dtype=np.int32), "INT32"


def words(n, word=b"stop"):
    return np.array([[word] * n], dtype=object), "BYTES"


# (case, ensemble inputs, text the error must hold: the field's name)
BAD_INPUTS = [
    ("missing text_input", dict(text_input=None), "text_input"),
    ("empty text_input", dict(text_input=(np.array([[b""]], dtype=object), "BYTES")), "text_input"),
    ("text_input not UTF-8", dict(text_input=(np.array([[b"caf\xe9 \xff"]], dtype=object), "BYTES")), "text_input"),
    ("prompt over the model's context", dict(text_input=(np.array([[b"word " * 9000]], dtype=object), "BYTES")),
     "text_input is"),
    ("text_input over the byte cap", dict(text_input=(np.array([[b"a" * (2 << 20)]], dtype=object), "BYTES")),
     "bytes"),
    ("max_tokens 0", dict(max_tokens=i32(0)), "max_tokens"),
    ("max_tokens negative", dict(max_tokens=i32(-5)), "max_tokens"),
    ("max_tokens beyond the context", dict(max_tokens=i32(1_000_000)), "max_tokens"),
    ("max_tokens as FP32", dict(max_tokens=f32(4.0)), "max_tokens"),
    ("max_tokens of shape [1, 2]", dict(max_tokens=(np.array([[4, 4]], dtype=np.int32), "INT32")), "max_tokens"),
    ("text_input as INT32", dict(text_input=i32(7)), "text_input"),
    ("temperature as INT32", dict(temperature=i32(1)), "temperature"),
    ("top_k as FP32", dict(top_k=f32(3.0)), "top_k"),
    ("temperature below 0", dict(temperature=f32(-0.5)), "temperature"),
    ("top_p 0", dict(top_p=f32(0.0)), "top_p"),
    ("top_p over 1", dict(top_p=f32(1.5)), "top_p"),
    ("top_k negative", dict(top_k=i32(-1)), "top_k"),
    ("repetition_penalty 0", dict(repetition_penalty=f32(0.0)), "repetition_penalty"),
    ("repetition_penalty negative", dict(repetition_penalty=f32(-1.0)), "repetition_penalty"),
    ("min_p over 1", dict(min_p=f32(2.0)), "min_p"),
    ("temperature NaN", dict(temperature=f32(float("nan"))), "temperature"),
    ("top_p NaN", dict(top_p=f32(float("nan"))), "top_p"),
    ("repetition_penalty infinite", dict(repetition_penalty=f32(float("inf"))), "repetition_penalty"),
    ("presence_penalty NaN", dict(presence_penalty=f32(float("nan"))), "presence_penalty"),
    ("frequency_penalty over 2", dict(frequency_penalty=f32(5.0)), "frequency_penalty"),
    ("min_tokens negative", dict(min_tokens=i32(-1)), "min_tokens"),
    ("seed out of range", dict(seed=(np.array([[2**64 - 1]], dtype=np.uint64), "UINT64")), "seed"),
    ("thousands of stop words", dict(stop_words=words(3000)), "stop_words"),
    ("stop words over the byte cap", dict(stop_words=words(2, b"x" * 10000)), "stop_words"),
    ("an empty stop word", dict(stop_words=(np.array([[b"."], [b""]], dtype=object).reshape(1, 2), "BYTES")),
     "stop_words"),
    ("thousands of bad words", dict(bad_words=words(3000, b"Paris")), "bad_words"),
    ("end_id outside the vocabulary", dict(end_id=i32(10_000_000)), "end_id"),
    ("end_id negative", dict(end_id=i32(-7)), "end_id"),
    ("malformed chat JSON", dict(text_input=None, messages=(np.array([[b'[{"role": "user", "content"']],
                                                                       dtype=object), "BYTES")), "messages"),
    ("chat JSON of the wrong shape", dict(text_input=None, messages=(np.array([[b'{"role": "user"}']], dtype=object),
                                                                     "BYTES")), "messages"),
]


@pytest.fixture(scope="module")
def good_answer(server):
    text, error = one_request(grpc_url(server), ensemble_inputs())
    assert error is None and text
    return text


@pytest.mark.parametrize("case, extra, field", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_grpc_input_names_the_field_and_the_connection_keeps_serving(server, good_answer, case, extra, field):
    stream = Stream(grpc_url(server))
    stream.send(ensemble_inputs(**extra), "bad")
    stream.send(ensemble_inputs(), "good")
    stream.close()
    assert len(stream.errors) == 1 and field in stream.errors[0], stream.errors
    assert "bad" not in stream.texts
    assert stream.text("good") == good_answer and stream.finish["good"] == "length"


BAD_HTTP_BODIES = [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "", "max_tokens": 4}, "text_input"),
    ({"text_input": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"text_input": QUESTION, "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"text_input": QUESTION, "max_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"text_input": QUESTION, "max_tokens": 4, "top_k": -1}, "top_k"),
    ({"text_input": QUESTION, "max_tokens": 4, "stop_words": ["stop"] * 3000}, "stop_words"),
    ({"text_input": QUESTION, "max_tokens": 4, "end_id": 10_000_000}, "end_id"),
    ({"messages": "[{not json", "max_tokens": 4}, "messages"),
]


@pytest.mark.parametrize("body, field", BAD_HTTP_BODIES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_HTTP_BODIES)])
def test_bad_http_input_names_the_field(server, good_answer, body, field):
    status, text = post(server, "generate", body)
    assert status == 400 and field in json.loads(text)["error"], text
    status, text = post(server, "generate", {"text_input": QUESTION, "max_tokens": 4, "apply_chat_template": False})
    assert status == 200 and json.loads(text)["text_output"] == good_answer


def test_bad_input_leaks_no_request_and_no_block(server):
    values = wait_until_idle(server)
    assert values["tritone_kv_blocks_used"] == 0 and values["tritone_num_requests_running"] == 0
    assert values["tritone_num_requests_waiting"] == 0


def test_a_cancelled_llm_stream_stops_within_steps_and_others_are_unaffected(server, tokenizer, good_answer):
    before = metric_values(server)["tritone_generation_tokens_total"]
    client = grpcclient.InferenceServerClient(grpc_url(server))
    received = []
    client.start_stream(callback=lambda result, error: received.append((result, error)))
    prompt_ids = np.array([tokenizer("Count to one thousand:").input_ids], dtype=np.int32)
    client.async_stream_infer("llm", grpc_inputs(("INPUT_IDS", prompt_ids, "INT32"), ("MAX_TOKENS", *i32(2000)),
                                                 ("END_ID", *i32(-1)), ("STREAM", np.array([[True]]), "BOOL")))
    other = Stream(grpc_url(server))
    other.send(ensemble_inputs(), "other")
    deadline = time.monotonic() + 60
    while len(received) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    before_cancel = list(received)
    client.stop_stream(cancel_requests=True)
    client.close()
    other.close()
    assert len(before_cancel) >= 5 and not any(error for _, error in before_cancel)
    assert other.text("other") == good_answer
    values = wait_until_idle(server)
    assert values["tritone_kv_blocks_used"] == 0 and values["tritone_num_requests_running"] == 0
    num_received = sum(len(result.as_numpy("TOKEN_IDS").reshape(-1)) for result, _ in received if result)
    # Generated after the cancel: the steps between it and the engine's next look at it.
    assert values["tritone_generation_tokens_total"] - before - 4 - num_received < 64


# ---- a small server: KV cache of 12 blocks (enough for 6 of the requests below), queue of 64 ----

MAX_QUEUE_LEN = 64


@pytest.fixture(scope="module")
def small_server(model_dir, tmp_path_factory):
    yield from supervised_server(
        tmp_path_factory, "small_server",
        "--kv-cache-bytes", str(12 * BLOCK_BYTES), "--max-queue-len", str(MAX_QUEUE_LEN),
        "--preprocessing-instances", "1", "--postprocessing-instances", "1",
        # How long a drain at shutdown may take.
        "--exit-timeout", "10")


@pytest.fixture(scope="module")
def alone(small_server):
    """Each prompt's greedy answer when it runs alone."""
    answers = {}
    for prompt in PROMPTS:
        text, error = one_request(grpc_url(small_server), ensemble_inputs(prompt, 12, end_id=i32(-1)))
        assert error is None
        answers[prompt] = text
    return answers


def test_many_more_streams_than_the_cache_holds_all_finish_with_their_alone_answers(small_server, alone):
    stream = Stream(grpc_url(small_server))
    num_requests = 6 * len(PROMPTS)  # 48 requests, 8x what the cache holds at once
    for i in range(num_requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        stream.send(ensemble_inputs(prompt, 12, end_id=i32(-1), stream=(np.array([[i % 2 == 0]]), "BOOL")), str(i))
    stream.close()
    assert stream.errors == []
    for i in range(num_requests):
        assert stream.text(str(i)) == alone[PROMPTS[i % len(PROMPTS)]], i
        assert stream.finish[str(i)] == "length"
    values = wait_until_idle(small_server)
    assert values["tritone_kv_blocks_used"] == 0
    assert values["tritone_preemptions_total"] > 0


def test_a_full_queue_answers_server_busy_and_serves_the_rest(small_server, alone):
    stream = Stream(grpc_url(small_server))
    num_requests = 4 * MAX_QUEUE_LEN
    for i in range(num_requests):
        stream.send(ensemble_inputs(PROMPTS[0], 12, end_id=i32(-1)), str(i))
    stream.close()
    assert stream.errors and all("server busy" in e for e in stream.errors), set(stream.errors)
    assert len(stream.errors) + len(stream.finish) == num_requests
    assert all(stream.text(i) == alone[PROMPTS[0]] for i in stream.finish)
    # Everything the queue held was served: more than one queue's worth finished.
    assert len(stream.finish) >= MAX_QUEUE_LEN
    assert wait_until_idle(small_server)["tritone_kv_blocks_used"] == 0


def abandon_http_stream(server, max_tokens):
    """Starts an HTTP generate_stream and disconnects after its first events."""
    open_http_generate_stream(server, max_tokens).close()


def abandon_grpc_stream(server, max_tokens):
    stream = Stream(grpc_url(server))
    stream.send(ensemble_inputs("Count to one thousand:", max_tokens, end_id=i32(-1), stream=(np.array([[True]]),
                                                                                              "BOOL")), "a")
    deadline = time.monotonic() + 60
    while len(stream.texts.get("a", [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    stream.close(cancel=True)


@pytest.mark.parametrize("abandon", [abandon_http_stream, abandon_grpc_stream], ids=["http-disconnect", "grpc-cancel"])
def test_an_abandoned_ensemble_stream_stops_early_and_frees_everything(small_server, alone, abandon):
    # Triton 2.51 passes neither an HTTP disconnect nor a gRPC cancellation into the ensemble's
    # running llm step, but marks the postprocessing steps that follow cancelled, and
    # postprocessing tells the engine (tests/test_openai.py times it on a 2,000-token request).
    # (Triton also keeps such a request counted in flight, which holds a shutdown to its exit
    # timeout, so this runs on the small server, not the session's.)
    server = small_server
    before = metric_values(server)["tritone_generation_tokens_total"]
    abandon(server, 48)
    text, error = one_request(grpc_url(server), ensemble_inputs(PROMPTS[0], 12, end_id=i32(-1)))
    assert error is None and text == alone[PROMPTS[0]]
    values = wait_until_idle(server)
    assert values["tritone_kv_blocks_used"] == 0 and values["tritone_num_requests_running"] == 0
    assert values["tritone_generation_tokens_total"] - before < 48 + 12


def llm_stub(server):
    for pid in server.stub_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if any(arg.startswith(b"llm_0") for arg in f.read().split(b"\0")):
                return pid
    raise AssertionError("no llm process found")


def is_ready(server):
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/ensemble/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_killed_llm_process_fails_in_flight_requests_and_the_server_comes_back(small_server, alone):
    streams = [Stream(grpc_url(small_server)) for _ in range(3)]
    for stream in streams:
        stream.send(ensemble_inputs("Count to one thousand:", 150, end_id=i32(-1),
                                    stream=(np.array([[True]]), "BOOL")), "0")
    deadline = time.monotonic() + 60
    while not all(stream.texts for stream in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(stream.texts for stream in streams)
    os.kill(llm_stub(small_server), signal.SIGKILL)
    # Every in-flight request ends in an error, none hangs; meanwhile the server is not ready.
    deadline = time.monotonic() + 120
    seen_unready = False
    while not all(stream.errors for stream in streams) and time.monotonic() < deadline:
        seen_unready = seen_unready or not is_ready(small_server)
        time.sleep(0.2)
    assert all(stream.errors and not stream.finish for stream in streams), [s.errors for s in streams]
    for stream in streams:
        stream.close()
    while small_server.num_restarts == 0 or not is_ready(small_server):
        seen_unready = seen_unready or not is_ready(small_server)
        assert time.monotonic() < deadline + 180, "the server did not come back"
        time.sleep(0.5)
    assert seen_unready
    text, error = one_request(grpc_url(small_server), ensemble_inputs(PROMPTS[0], 12, end_id=i32(-1)))
    assert error is None and text == alone[PROMPTS[0]]


def is_running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except OSError:
        return False


def describe(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[-80:]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return f"{pid} ({state}) {cmdline}"
    except OSError:
        return str(pid)


def test_model_processes_do_not_outlive_a_killed_server(small_server, alone):
    stream = Stream(grpc_url(small_server))
    stream.send(ensemble_inputs("Count to one thousand:", 150, end_id=i32(-1),
                                stream=(np.array([[True]]), "BOOL")), "0")
    deadline = time.monotonic() + 60
    while not stream.texts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream.texts
    stubs = small_server.stub_pids()
    assert stubs
    # The engine is generating when its server dies without a word to it.
    os.kill(small_server.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(map(is_running, stubs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in stubs if is_running(pid)]
    assert not survivors, f"a model process outlived its server: {[describe(pid) for pid in survivors]}"
    stream.close()
    # The launcher's supervisor brings the server back.
    deadline = time.monotonic() + 300
    while small_server.process.poll() is not None or not is_ready(small_server):
        assert time.monotonic() < deadline, "the server did not come back"
        time.sleep(0.5)
    text, error = one_request(grpc_url(small_server), ensemble_inputs(PROMPTS[0], 12, end_id=i32(-1)))
    assert error is None and text == alone[PROMPTS[0]]


def test_shutdown_lets_in_flight_requests_finish_and_refuses_new_ones(small_server, alone):
    stream = Stream(grpc_url(small_server))
    for i in range(8):
        stream.send(ensemble_inputs(PROMPTS[i], 12, end_id=i32(-1), stream=(np.array([[True]]), "BOOL")), str(i))
    deadline = time.monotonic() + 60
    while not stream.texts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stream.finish) < 8
    code = []
    stopping = threading.Thread(target=lambda: code.append(small_server.stop()))
    stopping.start()
    while not small_server.shutdown_file.exists():
        time.sleep(0.01)
    text, error = one_request(grpc_url(small_server), ensemble_inputs(PROMPTS[0], 4, end_id=i32(-1)))
    assert text is None and "server is shutting down" in error
    deadline = time.monotonic() + 60
    while len(stream.finish) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    # A client done with its stream closes it: Triton 2.51 does not unload a model while a gRPC
    # stream that used it is open, and would wait out its exit timeout.
    stream.close()
    stopping.join(timeout=60)
    # 0: nothing was left in flight (an expired exit timeout exits with an error).
    assert code == [0]
    assert stream.errors == []
    assert {i: stream.text(str(i)) for i in range(8)} == {i: alone[PROMPTS[i]] for i in range(8)}
