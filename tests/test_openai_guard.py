"""tritone-openai against hostile and careless clients, in process and without tritonserver: the
key and the body's size are checked before the body is read, malformed requests are refused with
OpenAI's error JSON and a 4xx before anything reaches the backend, and the server's own failures
reach the client as generic messages."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritone.openai.backend import Backend, Generation
from tritone.openai.errors import ENGINE_FAILED, UNAVAILABLE, Failure, classify_triton_error, error_body
from tritone.openai.guard import DEFAULT_MAX_BODY_BYTES, Guard
from tritone.openai.routes import OpenAIServer
from tritone.openai.server import build_parser

MODEL = "tiny"
KEY = "sekrit"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ---- an in-process ASGI client (httpx, which Starlette's TestClient needs, is not installed) ----

class Response:
    def __init__(self, status, headers, body, num_receives):
        self.status, self.headers, self.body, self.num_receives = status, headers, body, num_receives

    def json(self):
        return json.loads(self.body)

    @property
    def error(self) -> dict:
        """OpenAI's error object, checked for its shape."""
        error = self.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
        return error


def call(app, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         chunks=None) -> Response:
    """One request: `body` whole, with its Content-Length, or `chunks` (an iterable of bytes,
    sent as a chunked body: no Content-Length). After the body the client stays connected."""
    headers = {"content-type": "application/json", **(headers or {})}
    if body is not None and "content-length" not in headers:
        headers["content-length"] = str(len(body))
    messages = _messages(body, chunks)
    num_receives, sent = 0, []

    async def receive():
        nonlocal num_receives
        num_receives += 1
        message = next(messages, None)
        if message is None:
            await asyncio.Event().wait()  # connected, and silent
        return message

    async def send(message):
        sent.append(message)

    async def run():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 9000)}
        try:
            await asyncio.wait_for(app(scope, receive, send), 3)
        except Exception:  # Starlette re-raises after its 500 for the server's log; the answer is what counts
            pass

    asyncio.run(run())
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    return Response(start and start["status"], dict(start["headers"]) if start else {},
                    b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), num_receives)


def _messages(body: bytes | None, chunks):
    """The request's ASGI messages, made as they are received."""
    if chunks is None:
        yield {"type": "http.request", "body": body or b"", "more_body": False}
        return
    for chunk in chunks:
        yield {"type": "http.request", "body": chunk, "more_body": True}
    yield {"type": "http.request", "body": b"", "more_body": False}


def nested(depth: int) -> list:
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


def post(app, path: str, payload, headers=None) -> Response:
    return call(app, "POST", path, json.dumps(payload).encode(), headers=headers)


def must_not_receive():
    raise AssertionError("receive() called")


# ---- a backend that answers from a script, and records what reached it ----

def chunk_result(text: str, finish: str):
    """A real gRPC result of one chunk, as tritonserver would send it."""
    from test_client import grpc_result

    arrays = {"text_output": np.array([text.encode()], dtype=object),
              "num_input_tokens": np.array([3], dtype=np.int32), "num_output_tokens": np.array([1], dtype=np.int32)}
    if finish:
        arrays["finish_reason"] = np.array([finish.encode()], dtype=object)
    return grpc_result(arrays)


class FakeError:
    def __init__(self, message: str):
        self._message = message

    def message(self):
        return self._message


class FakeStream:
    """What tritonclient's stream_infer returns: (result, error) pairs; `fail` is raised instead."""

    def __init__(self, responses, fail: Exception | None = None):
        self.responses, self.fail = list(responses), fail

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail is not None:
            raise self.fail
        if not self.responses:
            raise StopAsyncIteration
        return self.responses.pop(0)

    def cancel(self):
        pass


class FakeBackend:
    sends_aborts = True

    def __init__(self, responses=None, fail: Exception | None = None):
        self.responses = responses if responses is not None else [(chunk_result("Paris.", "stop"), None)]
        self.fail = fail
        self.calls: list[dict[str, np.ndarray]] = []
        self.aborted: list[str] = []
        self.aborts = set()

    def generate(self, request_id, tensors, guide_field=None, echo=None):
        self.calls.append(tensors)
        return Generation(self, request_id, FakeStream(self.responses, self.fail), guide_field, echo)

    def _abort_later(self, request_id):
        self.aborted.append(request_id)


def served(backend=None, **options) -> tuple:
    server = OpenAIServer("127.0.0.1:1", MODEL, **options)
    server.backend = backend or FakeBackend()
    return server.app, server.backend


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **fields}


# ---- the key and the body's size, before the body ----

def test_a_wrong_or_missing_key_is_401_without_reading_the_body():
    app, backend = served(api_key=KEY)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {KEY}x"},
                    {"authorization": KEY}):
        # Refused before its body: a receive that fails, a Content-Length far over the limit.
        response = call(app, "POST", "/v1/chat/completions", headers={**headers, "content-length": "999999999999"},
                        chunks=iter(must_not_receive, None))
        assert response.status == 401 and response.num_receives == 0, (headers, response.status)
        assert response.error["type"] == "authentication_error" and "API key" in response.error["message"]
        assert response.headers[b"connection"] == b"close"
    for path in ("/v1/models", "/v1/models/tiny"):
        assert call(app, "GET", path).status == 401
    assert backend.calls == []


def test_the_right_key_is_served_and_health_is_open():
    app, backend = served(api_key=KEY)
    assert call(app, "GET", "/health").status == 200
    assert call(app, "GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == MODEL
    answer = post(app, "/v1/chat/completions", chat(), headers={"authorization": f"Bearer {KEY}"})
    assert answer.status == 200 and answer.json()["choices"][0]["message"]["content"] == "Paris."
    assert len(backend.calls) == 1


def test_an_oversized_content_length_is_413_unread():
    app, backend = served(max_body_bytes=1000)
    for length in ("1001", "99999999999999999999999999999999999999999999"):
        response = call(app, "POST", "/v1/chat/completions", headers={"content-length": length},
                        chunks=iter(must_not_receive, None))
        assert response.status == 413 and response.num_receives == 0
        assert "1000 bytes" in response.error["message"] and response.error["type"] == "invalid_request_error"
    # At the limit it is read and served.
    payload = json.dumps(chat()).encode()
    payload += b" " * (1000 - len(payload))
    assert call(app, "POST", "/v1/chat/completions", payload).status == 200
    assert len(backend.calls) == 1


def test_a_chunked_body_is_counted_and_refused_once_over_the_limit():
    app, backend = served(max_body_bytes=4096)
    response = call(app, "POST", "/v1/chat/completions", chunks=[b"x" * 1024] * 64)
    assert response.status == 413 and "4096 bytes" in response.error["message"]
    assert response.num_receives == 5  # stopped reading one chunk past the limit
    assert response.headers[b"connection"] == b"close"
    # A chunked body within the limit reaches the app whole.
    payload = json.dumps(chat()).encode()
    response = call(app, "POST", "/v1/chat/completions", chunks=[payload[:10], payload[10:]])
    assert response.status == 200 and backend.calls


def test_a_malformed_content_length_is_400():
    app, _ = served()
    for length in ("abc", "-1", "1e3", "+5", " "):
        response = call(app, "POST", "/v1/completions", headers={"content-length": length},
                        chunks=iter(must_not_receive, None))
        assert response.status == 400 and "Content-Length" in response.error["message"], length
        assert response.num_receives == 0


def test_the_body_limit_is_an_option_of_4_mib_by_default():
    assert build_parser().parse_args([]).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024
    assert build_parser().parse_args(["--max-body-bytes", "10"]).max_body_bytes == 10
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-body-bytes", "0"])


def test_no_generated_docs():
    for options, headers in (({}, {}), ({"api_key": KEY}, {"authorization": f"Bearer {KEY}"})):
        app, _ = served(**options)
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            response = call(app, "GET", path, headers=headers)
            assert response.status == 404 and response.error["type"] == "not_found_error", (path, response.body)


# ---- malformed requests: a 4xx naming the field, before the backend ----

MALFORMED = [  # (path, body, the field the refusal must name)
    ("/v1/chat/completions", chat(max_tokens=4294967297), "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=2**64), "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4294967297}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=2**31), "max_completion_tokens"),
    ("/v1/chat/completions", chat(top_k=2**32 + 5), "top_k"),
    ("/v1/chat/completions", chat(top_k=-1), "top_k"),
    ("/v1/chat/completions", chat(min_tokens=2**32), "min_tokens"),
    ("/v1/chat/completions", chat(n=2**32 + 1), "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 2**32}, "logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2**32), "top_logprobs"),
    ("/v1/chat/completions", chat(seed=2**64), "seed"),
    ("/v1/chat/completions", chat(temperature=1e39), "temperature"),  # inf as a float32
    ("/v1/chat/completions", chat(messages=[{"role": "assistant", "content": "", "tool_calls": 5}]),
     "messages[0].tool_calls"),
    ("/v1/chat/completions",
     chat(messages=[{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].id"),
    ("/v1/chat/completions", chat(messages=[7]), "messages[0]"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "y": nested(70)}]), "messages[0].y"),
    ("/v1/chat/completions", chat(tools=[5]), "tools[0]"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
     "tools[0].function.description"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": "f"}), "tool_choice"),
]


def test_malformed_fields_are_400_naming_the_field_before_the_backend():
    app, backend = served()
    for path, payload, field in MALFORMED:
        response = post(app, path, payload)
        assert response.status == 400, (field, response.body)
        assert field in response.error["message"] and response.error["param"].startswith(field.split(".")[0]), \
            (field, response.error)
    assert backend.calls == []


UNSENDABLE = [  # (path, body, the field the refusal must name)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "a\\udfffb"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}',
     "stop"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"tools": [{"type": "function", "function": {"name": "f\\udc00"}}]}', "tools[0]"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"guided_regex": "\\ud83d"}', "guided_regex"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "presence_penalty": -1e999}', "presence_penalty"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"response_format": {"type": "json_schema", "json_schema": {"schema": '
                             b'{"type": "number", "maximum": Infinity}}}}', "response_format.json_schema"),
]


def test_text_that_is_not_utf8_and_numbers_that_are_not_finite_are_400():
    app, backend = served()
    for path, raw, field in UNSENDABLE:
        response = call(app, "POST", path, raw)
        assert response.status == 400 and field in response.error["message"], (field, response.body)
    assert backend.calls == []


def test_bodies_that_are_not_json_objects_are_400_in_openai_shape():
    app, backend = served()
    for raw in (b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"[" * 100_000,
                b'{"max_tokens": 1' + b"0" * 5000 + b"}"):
        response = call(app, "POST", "/v1/completions", raw)
        assert 400 <= response.status < 500 and response.error["type"] == "invalid_request_error", raw[:20]
    assert call(app, "DELETE", "/v1/completions").status == 405
    assert call(app, "GET", "/v1/nothing").error["type"] == "not_found_error"
    assert backend.calls == []


# ---- the server's own failures: generic messages ----

def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


FAILURES = [  # (what the backend does, the status and message the client gets)
    (FakeBackend([(None, FakeError("Socket closed"))]), 503, UNAVAILABLE),
    (FakeBackend([(None, FakeError("failed to connect to all addresses; last error: 127.0.0.1:8001"))]), 503,
     UNAVAILABLE),
    (FakeBackend(fail=rpc_error(grpc.StatusCode.UNAVAILABLE, "ipv4:127.0.0.1:8001: Connection refused")), 503,
     UNAVAILABLE),
    (FakeBackend([(None, FakeError("in ensemble 'ensemble', engine error: CUDA error at /src/x.cu:42"))]), 500,
     ENGINE_FAILED),
    (FakeBackend(fail=rpc_error(grpc.StatusCode.INTERNAL, "Stub process at /opt/tritonserver is not healthy")), 500,
     ENGINE_FAILED),
]


def test_server_failures_reach_the_client_as_generic_messages(caplog):
    for backend, status, message in FAILURES:
        caplog.clear()
        with caplog.at_level(logging.WARNING, "tritone.openai"):
            response = post(served(backend)[0], "/v1/chat/completions", chat())
        assert response.status == status and response.error == {"message": message, "type": "server_error",
                                                                "param": None, "code": None}, response.body
        assert caplog.records  # the detail went to the log


def test_the_engines_refusals_and_busy_answers_pass_as_they_are():
    message = "in ensemble 'ensemble', max_tokens must be positive, got 0"
    response = post(served(FakeBackend([(None, FakeError(message))]))[0], "/v1/chat/completions", chat())
    assert response.status == 400 and response.error["message"] == "max_tokens must be positive, got 0"
    busy = "server busy: the request queue is full, retry later"
    response = post(served(FakeBackend([(None, FakeError(busy))]))[0], "/v1/chat/completions", chat())
    assert response.status == 503 and response.error["message"] == busy


def test_tritons_error_text_is_classified_in_one_place():
    # Triton's stream carries an error as text only: these are the words each kind arrives in.
    cases = {
        "Socket closed": Failure.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8001": Failure.UNAVAILABLE,
        "Request for unknown model: 'ensemble' is not found": Failure.UNAVAILABLE,
        "server busy: the request queue is full, retry later": Failure.BUSY,
        "server is shutting down: request not accepted": Failure.BUSY,
        "engine error: token 7 broke the request's grammar": Failure.ENGINE_FAILED,
        "max_tokens must be positive, got 0": Failure.REFUSED,
        "guided_decoding_guide: the schema is not valid JSON": Failure.REFUSED,
    }
    assert {message: classify_triton_error(message) for message in cases} == cases
    assert [f.status for f in Failure] == [400, 503, 503, 500]
    assert Failure.REFUSED.generic is Failure.BUSY.generic is None
    assert (Failure.UNAVAILABLE.generic, Failure.ENGINE_FAILED.generic) == (UNAVAILABLE, ENGINE_FAILED)


def test_a_failed_grpc_call_goes_by_its_status_code(caplog):
    # The same words under another code are the engine's failure: the code decides, not the text.
    for code, status in ((grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INTERNAL, 500),
                         (grpc.StatusCode.UNKNOWN, 500)):
        backend = FakeBackend(fail=rpc_error(code, "Socket closed"))
        with caplog.at_level(logging.WARNING, "tritone.openai"):
            response = post(served(backend)[0], "/v1/chat/completions", chat())
        assert response.status == status, (code, response.body)


def test_an_unexpected_exception_is_a_generic_500(caplog):
    class Broken(FakeBackend):
        def generate(self, *args, **kwargs):
            raise KeyError("/srv/secret/path")

    app, _ = served(Broken())
    with caplog.at_level(logging.ERROR, "tritone.openai"):
        response = post(app, "/v1/chat/completions", chat())
    assert response.status == 500 and b"secret" not in response.body
    assert response.error == {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    assert any(r.exc_info for r in caplog.records)


def test_after_the_body_the_app_hears_the_clients_disconnect():
    # What a streamed response and _unless_gone rely on: the guard reads the body, then gets
    # out of the way of the connection's receive.
    heard = []

    async def app(scope, receive, send):
        heard.extend([await receive(), await receive()])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    messages = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                     {"type": "http.request", "body": b"c", "more_body": False}, {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"3")]}
    asyncio.run(Guard(app, max_body_bytes=3)(scope, receive, send))
    assert heard == [{"type": "http.request", "body": b"abc", "more_body": False}, {"type": "http.disconnect"}]


def test_error_messages_are_cut_short_and_utf8():
    error = error_body("model 'a\ud800" + "b" * 10_000 + "' does not exist", param="a\udfff")["error"]
    json.dumps(error, ensure_ascii=False).encode("utf-8")
    assert len(error["message"]) < 600 and "\\ud800" in error["message"] and error["param"] == "a\\udfff"


def test_a_stream_passes_the_guard_whole():
    backend = FakeBackend([(chunk_result("Par", ""), None), (chunk_result("is.", "stop"), None)])
    app, _ = served(backend, api_key=KEY)
    response = post(app, "/v1/chat/completions", chat(stream=True), headers={"authorization": f"Bearer {KEY}"})
    events = [line.removeprefix(b"data: ") for line in response.body.split(b"\n\n") if line]
    assert response.status == 200 and events[-1] == b"[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Paris."


def test_streamed_tool_calls_finish_for_tool_calls():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    backend = FakeBackend([(chunk_result("Let me look.\n", ""), None), (chunk_result(call[:9], ""), None),
                           (chunk_result(call[9:], "stop"), None)])
    response = post(served(backend)[0], "/v1/chat/completions", chat(stream=True, tools=tools))
    events = [json.loads(line.removeprefix(b"data: ")) for line in response.body.split(b"\n\n")[:-2] if line]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n"
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["tool_calls"]


class SlowStream(FakeStream):
    """A stream whose responses come 20 ms apart, and that knows whether it was cancelled."""

    def __init__(self, responses):
        super().__init__(responses)
        self.cancelled = False

    async def __anext__(self):
        await asyncio.sleep(0.02)
        return await super().__anext__()

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("sends_aborts", [True, False])
def test_a_client_that_leaves_has_the_engine_end_its_request_which_is_read_to_its_end(stream, sends_aborts):
    # Triton 2.51 counts a cancelled ensemble request in flight for good: through the ensemble
    # the engine is told to abort, and the stream is read on to its end (the engine's final
    # response); only llm_inline, which has no abort, sees its stream cancelled.
    streams = []

    class Backend(FakeBackend):
        def generate(self, request_id, tensors, guide_field=None, echo=None):
            streams.append(SlowStream([(chunk_result(f"{i} ", ""), None) for i in range(30)]
                                      + [(chunk_result("", "cancelled"), None)]))
            return Generation(self, request_id, streams[-1], guide_field, echo)

    backend = Backend()
    backend.sends_aborts = sends_aborts
    app, _ = served(backend)
    body = json.dumps(chat(stream=stream, max_tokens=100)).encode()
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    leaves_at = []

    async def receive():  # the client leaves 50 ms after its request, mid-stream
        message = next(messages, None)
        if message is not None:
            leaves_at.append(time.monotonic() + 0.05)
            return message
        if time.monotonic() < leaves_at[0]:  # Starlette's is_disconnected() gives up at once
            await asyncio.sleep(leaves_at[0] - time.monotonic())
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 9000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def run():
        try:
            await asyncio.wait_for(app(scope, receive, send), 5)
        except Exception:
            pass
    asyncio.run(run())
    (read,) = streams
    if sends_aborts:
        assert len(backend.aborted) == 1 and not read.cancelled and read.responses == []
    else:
        assert read.cancelled and read.responses


# ---- the control key on aborts ----

def test_an_abort_carries_the_control_key():
    for control_key in ("k3y-\u00e9", None):
        request = sent_abort(control_key)
        tensors = {t.name(): t for t in request["inputs"]}
        assert request["model_name"] == "llm" and b"chatcmpl-1" in tensors["ABORT_REQUEST_ID"]._raw_content
        if control_key is None:
            assert "CONTROL_KEY" not in tensors
        else:
            key = tensors["CONTROL_KEY"]
            assert key.datatype() == "BYTES" and key.shape() == [1, 1]
            assert key._raw_content.endswith(control_key.encode())


def sent_abort(control_key: str | None) -> dict:
    """The request Backend.abort sends."""
    sent = []

    class Client:
        def stream_infer(self, requests):
            async def responses():
                async for request in requests:
                    sent.append(request)
                yield None, None
            return responses()

        async def close(self):
            pass

    async def run():
        backend = Backend("127.0.0.1:1", control_key)
        await backend.client.close()
        backend.client = Client()
        await backend.abort("chatcmpl-1")

    asyncio.run(run())
    (request,) = sent
    return request


def test_without_a_control_key_the_start_warns(caplog):
    async def start(server):
        lifespan = server._lifespan(server.app)
        await lifespan.__anext__()
        await server.backend.close()

    for control_key, warned in (("k", False), (None, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "tritone.openai"):
            asyncio.run(start(OpenAIServer("127.0.0.1:1", MODEL, control_key=control_key)))
        assert any("TRITONE_CONTROL_KEY" in r.getMessage() for r in caplog.records) == warned


# ---- random bodies: a 4xx, or an answer from the backend; never a 5xx ----
# Well-formed bodies with one part (anywhere: a field, a message's role, a tool's name) replaced by
# any JSON at all, and optional fields at the values a hostile client picks (ints past int32 and
# int64, NaN, lone surrogates). Each aspect of a request is also fuzzed with the rest plain, so
# that a refusal elsewhere does not hide a failure there.

PLAIN = st.text(max_size=8)
# Lone surrogates: json.dumps writes them as the escapes \\udXXX, which JSON parsers accept.
ODD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\x00", ""]) | st.text(st.characters(exclude_categories=()),
                                                                       max_size=8)
# Hypothesis favours the first branch of a one_of: ordinary text mostly, odd text at times.
TEXT = st.one_of(PLAIN, PLAIN, PLAIN, ODD_TEXT)
INT_EDGES = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32 + 1, 2**63, 2**64, -2**64, 10**30]) | st.integers()
FLOAT_EDGES = st.sampled_from([0.0, -1.0, 1e39, -1e39, float("nan"), float("inf"), -float("inf")]) | st.floats()
# Any JSON, with a value of the wrong type first (Hypothesis favours it): the usual confusion.
JSON = st.sampled_from([5, -1, 1.5, True, False, None, "x", "", [], {}, [5], {"x": 5}]) | st.recursive(
    st.none() | st.booleans() | INT_EDGES | FLOAT_EDGES | PLAIN | ODD_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(PLAIN | ODD_TEXT, inner, max_size=3), max_leaves=8)

CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
TOOL_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]), "arguments": st.just('{"a": 1}') | st.dictionaries(TEXT, JSON, max_size=2)})})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": CONTENT}),
    st.fixed_dictionaries({"role": st.just("assistant")},
                          optional={"content": CONTENT, "tool_calls": st.lists(TOOL_CALL, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": CONTENT},
                          optional={"tool_call_id": TEXT, "name": TEXT}))
SCHEMA = st.sampled_from([{}, {"type": "object", "properties": {"a": {"type": "integer"}}}]) \
    | st.dictionaries(TEXT, JSON, max_size=2)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])}, optional={"description": TEXT, "parameters": SCHEMA})})
TOOL_CHOICE = st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})})
GUIDES = {
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": SCHEMA})}),
    "guided_json": SCHEMA, "guided_regex": TEXT, "guided_choice": st.lists(TEXT, min_size=1, max_size=2),
    "guided_grammar": TEXT, "structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]), TEXT | SCHEMA, min_size=1,
        max_size=1),
}
# Each optional field: (its ordinary values, a hostile client's).
SAMPLING = {
    "max_tokens": (st.integers(1, 64), INT_EDGES), "top_k": (st.integers(0, 64), INT_EDGES),
    "min_tokens": (st.integers(0, 8), INT_EDGES), "seed": (st.integers(0, 2**64 - 1), INT_EDGES),
    "temperature": (st.floats(0, 2), FLOAT_EDGES), "top_p": (st.floats(0.01, 1), FLOAT_EDGES),
    "min_p": (st.floats(0, 1), FLOAT_EDGES), "presence_penalty": (st.floats(-2, 2), FLOAT_EDGES),
    "frequency_penalty": (st.floats(-2, 2), FLOAT_EDGES), "repetition_penalty": (st.floats(0.5, 2), FLOAT_EDGES),
    "stop": (PLAIN | st.lists(PLAIN, max_size=2), ODD_TEXT | st.lists(ODD_TEXT, min_size=1, max_size=2)),
    "ignore_eos": (st.booleans(), JSON), "user": (PLAIN, ODD_TEXT), "n": (st.just(1), INT_EDGES),
}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OPTIONAL = {
    CHAT: {**SAMPLING, "max_completion_tokens": (st.integers(1, 64), INT_EDGES),
           "top_logprobs": (st.just(0), INT_EDGES), "logprobs": (st.booleans(), JSON),
           "parallel_tool_calls": (st.booleans(), JSON),
           "logit_bias": (st.just({}), st.dictionaries(PLAIN, FLOAT_EDGES, min_size=1, max_size=1))},
    COMPLETIONS: {**SAMPLING, "logprobs": (st.integers(0, 1), INT_EDGES), "best_of": (st.just(1), INT_EDGES),
                  "echo": (st.just(False), JSON), "suffix": (st.just(""), JSON)},
}
STREAM_OPTIONS = st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                    "continuous_usage_stats": st.booleans()})


@st.composite
def spoiled(draw, strategy, whole: bool = True):
    """A value of `strategy` with one of its parts (or, if `whole`, itself) replaced by any JSON,
    or, one time in as many as it has parts, left as it is."""
    value = copy.deepcopy(draw(strategy))  # st.just hands out one object every time
    container, key = draw(st.sampled_from([(None, None), *_places(value)]))
    if container is None:
        return draw(JSON) if whole and draw(st.booleans()) else value
    container[key] = draw(JSON)
    return value


def _places(value):
    """(container, key) of every part of a JSON value, outermost first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, part in list(items):
        yield value, key
        yield from _places(part)


@st.composite
def plain(draw, path: str) -> dict:
    body = {"model": MODEL, "stream": draw(st.booleans())}
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = draw(STREAM_OPTIONS)
    body.update({"messages": QUESTION} if path == CHAT else {"prompt": "Hello"})
    return body


@st.composite
def sampling(draw, path: str) -> dict:
    """Some of the optional fields, ordinary, and one or two at a hostile client's values."""
    optional = OPTIONAL[path]
    fields = {name: draw(ordinary) for name, (ordinary, _) in optional.items() if draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=2, unique=True)):
        fields[name] = draw(optional[name][1])
    return fields


@st.composite
def messages(draw, path: str) -> dict:
    if path == CHAT:
        return {"messages": draw(spoiled(st.lists(MESSAGE, min_size=1, max_size=3)))}
    return {"prompt": draw(spoiled(TEXT | st.lists(TEXT, min_size=1, max_size=1)))}


@st.composite
def tools(draw, path: str) -> dict:
    fields = {"tools": draw(st.lists(TOOL, min_size=1, max_size=2))}
    if draw(st.booleans()):
        fields["tool_choice"] = draw(TOOL_CHOICE)
    return draw(spoiled(st.just(fields), whole=False))


@st.composite
def guides(draw, path: str) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(GUIDES)), min_size=1, max_size=2, unique=True))
    return draw(spoiled(st.just({name: draw(GUIDES[name]) for name in names}), whole=False))


@st.composite
def anything(draw, path: str) -> dict:
    """A little of everything, then one part of the whole body spoiled."""
    body = {**draw(plain(path)), **draw(sampling(path))}
    if path == CHAT:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=3))
        if draw(st.booleans()):
            body.update(draw(tools(path)))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(GUIDES)))
        body[name] = draw(GUIDES[name])
    return draw(spoiled(st.just(body)))


def bodies(path: str, aspect):
    if aspect is anything:
        return anything(path)
    return st.builds(lambda base, fields: {**base, **fields}, plain(path), aspect(path))


@functools.cache
def fuzzed_app():
    return served()


@pytest.mark.parametrize("path, aspect", [(CHAT, anything), (COMPLETIONS, anything), (CHAT, sampling),
                                          (COMPLETIONS, sampling), (CHAT, messages), (COMPLETIONS, messages),
                                          (CHAT, tools), (CHAT, guides), (COMPLETIONS, guides)],
                         ids=lambda x: getattr(x, "__name__", x))
def test_random_bodies_get_a_4xx_or_reach_the_backend_never_a_5xx(path, aspect):
    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(bodies(path, aspect))
    def check(body):
        app, backend = fuzzed_app()
        backend.calls.clear()
        response = call(app, "POST", path, json.dumps(body).encode())
        assert response.status is not None and response.status < 500, (response.status, response.body)
        if response.status >= 400:
            assert response.error["type"] in ("invalid_request_error", "not_found_error")
            assert backend.calls == []
            return
        # One generation per sequence (n, or best_of) of each prompt of a completion; a list of
        # token ids is one prompt, a list of texts or of token-id lists one prompt each.
        prompts = body.get("prompt")
        num_prompts = len(prompts) if isinstance(prompts, list) and not isinstance(prompts[0], int) else 1
        num_seqs = body.get("best_of") or body.get("n", 1)
        assert len(backend.calls) == num_prompts * num_seqs
        tensors = backend.calls[0]
        for array in tensors.values():
            if array.dtype == object:
                for value in array.reshape(-1):
                    value.decode("utf-8")
            elif array.dtype == np.float32:
                assert np.isfinite(array).all()
        # What reached the backend is what was asked, not a wrapped number.
        asked = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
                 "top_k": body.get("top_k"), "min_tokens": body.get("min_tokens")}
        for name, value in asked.items():
            if type(value) is int:
                assert int(tensors[name][0, 0]) == value

    check()
