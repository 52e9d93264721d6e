"""tritone-openai: OpenAI's completions and chat API in front of the `ensemble`.

A process of its own (so the engine's process does no HTTP work), talking to tritonserver over
gRPC streaming on one shared channel. Every request goes out with its own Triton request id, the
OpenAI id of its answer. When a client goes away before the end, the front end cancels the gRPC
stream and also tells the `llm` model directly to abort that id (an ABORT_REQUEST_ID control
request): Triton 2.51 does not pass a cancellation into the ensemble's running llm step, and the
direct word reaches a request still waiting for the engine or in a long prefill, which has no
responses for postprocessing to notice the cancellation by. The llm model obeys a control request
only with the server's secret (CONTROL_KEY), which the front end takes from $TRITONE_CONTROL_KEY.

Nothing of the server's own reaches a client: a refusal names the client's field, and a failure
on the server's side is a generic message (the detail goes to the log).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from tritone_client.client import infer_inputs

from tritone.openai.guard import DEFAULT_MAX_BODY_BYTES, Guard
from tritone.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body, finish_reason
from tritone.openai.tools import PARSERS, ToolStream, parse_tool_calls

logger = logging.getLogger("tritone.openai")
ENSEMBLE = "ensemble"
# Triton's prefix on a composing model's error, which tells an OpenAI client nothing.
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
# How long an abort sent to the engine may take before the front end gives up on it.
_ABORT_TIMEOUT_SECONDS = 5.0
# What a client hears when tritonserver cannot be reached, or the engine failed: the detail is
# the server's business, and goes to the log.
UNAVAILABLE = "the model server is unavailable, retry later"
ENGINE_FAILED = "the engine failed on this request"
# Triton's and gRPC's words for a server that is not there (or not serving the ensemble yet).
_UNAVAILABLE_SIGNS = ("socket closed", "failed to connect", "unavailable", "connection refused", "unknown model")


@dataclass(slots=True)
class Chunk:
    """One ensemble response: the text delta (or whole text) and the counts so far."""

    text: str
    num_input_tokens: int | None  # from the first and the final response
    num_output_tokens: int
    log_probs: list[float]
    finish_reason: str | None


@dataclass(slots=True)
class Answer:
    """A whole answer, joined from its chunks."""

    text: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.num_input_tokens, self.num_output_tokens = chunk.num_input_tokens, chunk.num_output_tokens
        self.log_probs += chunk.log_probs
        self.finish_reason = chunk.finish_reason or self.finish_reason


def error_status(message: str) -> int:
    """The HTTP status of an error the server answered with: the engine's own messages name
    the field of a bad request; a full queue, a draining server or one that cannot be reached
    is a retry-later."""
    if "server busy" in message or "shutting down" in message or is_unavailable(message):
        return 503
    if message.startswith("engine error"):
        return 500
    return 400


def is_unavailable(message: str, code: str = "") -> bool:
    return "UNAVAILABLE" in code or any(sign in message.lower() for sign in _UNAVAILABLE_SIGNS)


def server_error(message: str, guide_field: str | None = None) -> RequestError:
    """What the client is told of an error response: the engine's refusals as they are (they
    name the field; a constraint's under the OpenAI field it came from), the server's own
    failures as generic messages."""
    status = error_status(message)
    if status == 503 and is_unavailable(message):
        logger.warning("the model server is unavailable: %s", message)
        return RequestError(UNAVAILABLE, status=503, type="server_error")
    if status == 500:
        logger.error("%s", message)
        return RequestError(ENGINE_FAILED, status=500, type="server_error")
    param = None
    if guide_field and message.startswith("guided_decoding_guide"):
        # The engine names the ensemble's input; the client sent an OpenAI field.
        message = guide_field + message.removeprefix("guided_decoding_guide_type").removeprefix(
            "guided_decoding_guide")
        param = guide_field
    return RequestError(message, param, status=status, type="server_error" if status >= 500 else
                        "invalid_request_error")


class Backend:
    """The ensemble over one gRPC channel, shared by every request."""

    def __init__(self, url: str, control_key: str | None = None):
        import tritonclient.grpc.aio as grpcaio

        self._grpcaio = grpcaio
        self.client = grpcaio.InferenceServerClient(url)
        # The llm model's secret for control requests; without it an abort is refused.
        self.control_key = control_key
        self.aborts: set[asyncio.Task] = set()

    def _inputs(self, tensors: dict[str, np.ndarray]) -> list:
        return infer_inputs(self._grpcaio, tensors.items())

    def generate(self, request_id: str, tensors: dict[str, np.ndarray], guide_field: str | None = None) -> "Generation":
        """The ensemble's responses to one request, as a Generation; `guide_field` names the
        OpenAI field of its output constraint in the engine's errors about it."""
        inputs = self._inputs(tensors)

        async def requests():
            yield {"model_name": ENSEMBLE, "inputs": inputs, "request_id": request_id}

        return Generation(self, request_id, self.client.stream_infer(requests()), guide_field)

    def _abort_later(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self.aborts.add(task)
        task.add_done_callback(self.aborts.discard)

    async def abort(self, request_id: str) -> None:
        """Tells the llm model to stop the engine's request of this Triton request id."""
        tensors = {"ABORT_REQUEST_ID": np.array([[request_id.encode()]], dtype=object)}
        if self.control_key:
            tensors["CONTROL_KEY"] = np.array([[self.control_key.encode()]], dtype=object)
        inputs = self._inputs(tensors)

        async def requests():
            # The llm answers a control request with a final flag and no tensors, which Triton
            # sends to a gRPC client only when asked to.
            yield {"model_name": "llm", "inputs": inputs, "parameters": {"triton_enable_empty_final_response": True}}

        async def send():
            async for _, error in self.client.stream_infer(requests()):
                if error is not None:
                    logger.warning("abort of %s failed: %s", request_id, error)
                break

        try:
            await asyncio.wait_for(send(), _ABORT_TIMEOUT_SECONDS)
        except Exception as exc:  # the client is gone; the request still ends at max_tokens
            logger.warning("abort of %s failed: %r", request_id, exc)

    async def close(self) -> None:
        await self.client.close()


class Generation:
    """Iterates over one request's chunks; raises RequestError for an error response. close()
    before the last response cancels the gRPC stream and aborts the request in the engine. It
    does not wait, so that it also works from code that is being cancelled (a client's
    disconnect cancels the response's task)."""

    def __init__(self, backend: Backend, request_id: str, stream, guide_field: str | None = None):
        self.backend, self.request_id, self.stream = backend, request_id, stream
        self.guide_field = guide_field
        # The final response came, or an error: nothing left to cancel in the engine.
        self.is_answered = False
        # The prompt's count comes with the first and the final response; each chunk carries it.
        self.num_input_tokens = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        # After the final response the server ends the stream: read on to that end, since a
        # call left open at the last response is cancelled, and Triton 2.51 may then count the
        # ensemble request in flight for good (tritone_client.load reads to the end too).
        try:
            result, error = await self.stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            raise self._failed(exc) from None
        if error is not None:
            self.is_answered = True
            message = _ENSEMBLE_PREFIX.sub("", error.message() if hasattr(error, "message") else str(error))
            raise server_error(message, self.guide_field)
        chunk = _chunk(result)
        if chunk.num_input_tokens is None:
            chunk.num_input_tokens = self.num_input_tokens
        self.num_input_tokens = chunk.num_input_tokens
        self.is_answered = self.is_answered or chunk.finish_reason is not None
        return chunk

    def _failed(self, exc: Exception) -> RequestError:
        """grpc.aio raises a failed call (a server that cannot be reached, or went away) rather
        than answering with an error response."""
        code = exc.code() if callable(getattr(exc, "code", None)) else ""
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if is_unavailable(str(details), str(code)):
            self.is_answered = True  # nothing there to abort
            logger.warning("the model server is unavailable: %s %s", code, details)
            return RequestError(UNAVAILABLE, status=503, type="server_error")
        logger.error("the gRPC stream of %s failed: %r", self.request_id, exc)
        return RequestError(ENGINE_FAILED, status=500, type="server_error")

    async def read_to_end(self) -> None:
        async for _ in self:
            pass

    def close(self) -> None:
        if not self.is_answered:
            self.is_answered = True
            self.stream.cancel()
            self.backend._abort_later(self.request_id)


def _chunk(result) -> Chunk:
    def scalar(name, default=None):
        array = result.as_numpy(name)  # the prompt's count and the finish reason: final chunk only
        return default if array is None else array.reshape(-1)[0]

    text = scalar("text_output")
    reason = scalar("finish_reason", b"")
    num_input_tokens = scalar("num_input_tokens")
    return Chunk(
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
        num_input_tokens=None if num_input_tokens is None else int(num_input_tokens),
        num_output_tokens=int(scalar("num_output_tokens")),
        # Only requests that asked for log probabilities get them.
        log_probs=[] if (log_probs := result.as_numpy("output_log_probs")) is None else log_probs.reshape(-1).tolist(),
        finish_reason=finish_reason(reason.decode() if isinstance(reason, bytes) else str(reason)),
    )


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)


def _param(loc) -> str | None:
    """The field a validation error's location names, as the client wrote it: messages[0].role."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class OpenAIServer:
    """The routes, for one served model name, over one Backend."""

    def __init__(self, backend_url: str, model_name: str, api_key: str | None = None, tool_parser: str = "hermes",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, control_key: str | None = None):
        self.backend_url, self.model_name, self.api_key = backend_url, model_name, api_key
        self.tool_parser, self.control_key = tool_parser, control_key
        self.backend: Backend | None = None
        self.created = int(time.time())
        # No generated docs: they would describe the server to anyone who asks, key or not.
        self.app = FastAPI(title="tritone-openai", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                           openapi_url=None)
        self.app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
        self._routes()

    async def _lifespan(self, app):
        if not self.control_key:
            logger.warning("TRITONE_CONTROL_KEY is not set: aborts of requests whose clients leave cannot reach "
                           "the engine (they run on to max_tokens); set it to the server's control key")
        self.backend = Backend(self.backend_url, self.control_key)
        yield
        if self.backend.aborts:
            await asyncio.wait(self.backend.aborts, timeout=_ABORT_TIMEOUT_SECONDS)
        await self.backend.close()

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc: RequestValidationError):
            first = exc.errors()[0]
            if first.get("type") == "json_invalid":
                position = (first.get("loc") or ("body", "?"))[-1]
                message = f"the body is not valid JSON: {(first.get('ctx') or {}).get('error', first.get('msg'))} " \
                          f"(at character {position})"
                return error_response(RequestError(message))
            param = _param(first.get("loc", ()))
            if first.get("type") == "extra_forbidden":
                message = f"{param} is not a supported parameter"
            else:
                message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            return error_response(RequestError(message, param))

        @app.exception_handler(HTTPException)
        async def http_error(_, exc: HTTPException):
            # Starlette's own refusals (no such route, a wrong method, a body that is not JSON
            # text) in OpenAI's shape.
            type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(error_body(str(exc.detail), type), status_code=exc.status_code, headers=exc.headers)

        @app.exception_handler(Exception)
        async def failed(request: Request, exc: Exception):
            # The aim is that nothing gets here; what does is the server's fault, not the client's.
            logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
            return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

        @app.exception_handler(ClientGone)
        async def gone(_, exc: ClientGone):
            return JSONResponse(error_body("client disconnected"), status_code=499)

        @app.exception_handler(RequestError)
        async def refused(_, exc: RequestError):
            return error_response(exc)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            self._check_model(name)
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._serve(body, request, "cmpl", _CompletionFormat)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            return await self._serve(body, request, "chatcmpl", _ChatFormat)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tritone"}

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(f"model {name!r} does not exist: this server serves {self.model_name!r}", "model",
                               status=404, type="not_found_error")

    async def _serve(self, body, request: Request, prefix: str, format_cls):
        self._check_model(body.model)
        body.check_supported()
        calls_tools = getattr(body, "calls_tools", False)
        fmt = format_cls(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), self.model_name, body.wants_logprobs,
                         self.tool_parser if calls_tools else None)
        inputs = body.ensemble_inputs()
        if calls_tools:
            body.tool_inputs(inputs, self.tool_parser)
        guide = body.guide()
        chunks = self.backend.generate(fmt.id, inputs, "tools" if calls_tools else guide and guide[0])
        try:
            if not body.stream:
                answer = await _unless_gone(request, _join(chunks))
                return fmt.whole(answer)
            # The first response decides the status: an error before any token is an HTTP error.
            first = await _unless_gone(request, chunks.__anext__())
        except StopAsyncIteration:
            raise RequestError("the server ended the stream without an answer", status=500, type="server_error")
        except BaseException:
            chunks.close()
            raise
        return StreamingResponse(self._events(fmt, first, chunks, body.include_usage, body.continuous_usage),
                                 media_type="text/event-stream")

    async def _events(self, fmt, first: Chunk, chunks: Generation, include_usage: bool, continuous_usage: bool):
        # On a client's disconnect Starlette cancels this generator's task: close() then
        # cancels the gRPC stream and aborts the request in the engine.
        last = first
        tools = ToolStream(fmt.tool_parser) if fmt.tool_parser else None
        try:
            yield _sse(fmt.start(include_usage))
            chunk = first
            while True:
                last = chunk
                if tools is not None:
                    chunk = dataclasses.replace(chunk, text=tools.feed(chunk.text))
                    if chunk.finish_reason:
                        rest, calls = tools.finish()
                        chunk.text += rest
                        if calls:
                            if chunk.text:
                                yield _sse(fmt.delta(dataclasses.replace(chunk, finish_reason=None, log_probs=[]),
                                                     include_usage))
                            yield _sse(fmt.tool_delta(calls, include_usage))
                            chunk = dataclasses.replace(chunk, text="", finish_reason=_tool_finish(chunk.finish_reason))
                if chunk.text or chunk.log_probs or chunk.finish_reason:
                    yield _sse(fmt.delta(chunk, include_usage, continuous_usage))
                if chunk.finish_reason:
                    break
                chunk = await chunks.__anext__()
            await chunks.read_to_end()
            if include_usage:
                yield _sse(fmt.usage(last))
        except RequestError as exc:  # after the first response: reported in the stream
            yield _sse(error_body(exc.message, exc.type, exc.param))
        except StopAsyncIteration:
            pass
        finally:
            chunks.close()
        yield _sse("[DONE]")


async def _join(chunks: Generation) -> Answer:
    answer = Answer()
    async for chunk in chunks:
        answer.add(chunk)
    return answer


class ClientGone(Exception):
    pass


async def _unless_gone(request: Request, awaitable, poll_seconds: float = 0.2):
    """The awaitable's result, unless the client disconnects first (ClientGone). Starlette
    notices a disconnect by itself only once a streamed body is being sent; before that (a
    request waiting in the engine's queue, a long prefill, a whole answer) it is looked for here."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_seconds)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        task.cancel()


def _usage(answer) -> dict:
    return {"prompt_tokens": answer.num_input_tokens, "completion_tokens": answer.num_output_tokens,
            "total_tokens": answer.num_input_tokens + answer.num_output_tokens}


@dataclass(slots=True)
class _Format:
    id: str
    created: int
    model: str
    wants_logprobs: bool
    # The tool-call syntax to parse the answer by (chat with tools), else None.
    tool_parser: str | None = None

    def _envelope(self, object_: str, choices: list, usage=None, with_usage_key: bool = False) -> dict:
        """OpenAI's envelope; with include_usage, every chunk has a usage key (null but in the last)."""
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return body


class _CompletionFormat(_Format):
    def _logprobs(self, values: list[float]):
        # Only the chosen tokens' values: the ensemble returns no token ids to name them by.
        return {"token_logprobs": values, "tokens": None, "top_logprobs": None, "text_offset": None} \
            if self.wants_logprobs else None

    def whole(self, a: Answer) -> dict:
        choice = {"index": 0, "text": a.text, "logprobs": self._logprobs(a.log_probs), "finish_reason": a.finish_reason}
        return self._envelope("text_completion", [choice], _usage(a))

    def start(self, include_usage: bool) -> dict:
        return self.delta(Chunk("", 0, 0, [], None), include_usage)

    def delta(self, c: Chunk, include_usage: bool, continuous_usage: bool = False) -> dict:
        choice = {"index": 0, "text": c.text, "logprobs": self._logprobs(c.log_probs), "finish_reason": c.finish_reason}
        return self._envelope("text_completion", [choice], _usage(c) if continuous_usage else None, include_usage)

    def usage(self, last: Chunk) -> dict:
        return self._envelope("text_completion", [], _usage(last))


class _ChatFormat(_Format):
    def _logprobs(self, values: list[float]):
        # Only the chosen tokens' values: the ensemble returns no token ids to name them by.
        return {"content": [{"token": "", "logprob": v, "bytes": None, "top_logprobs": []} for v in values]} \
            if self.wants_logprobs else None

    def whole(self, a: Answer) -> dict:
        message = {"role": "assistant", "content": a.text}
        reason = a.finish_reason
        if self.tool_parser:
            content, calls = parse_tool_calls(a.text, self.tool_parser)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
                reason = _tool_finish(reason)
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(a.log_probs), "finish_reason": reason}
        return self._envelope("chat.completion", [choice], _usage(a))

    def tool_delta(self, calls, include_usage: bool) -> dict:
        # Each call whole in one delta: its id, name and all its arguments.
        choice = {"index": 0, "delta": {"tool_calls": [c.as_openai(i) for i, c in enumerate(calls)]},
                  "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], None, include_usage)

    def start(self, include_usage: bool) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], with_usage_key=include_usage)

    def delta(self, c: Chunk, include_usage: bool, continuous_usage: bool = False) -> dict:
        choice = {"index": 0, "delta": {"content": c.text} if c.text else {},
                  "logprobs": self._logprobs(c.log_probs), "finish_reason": c.finish_reason}
        return self._envelope("chat.completion.chunk", [choice], _usage(c) if continuous_usage else None,
                              include_usage)

    def usage(self, last: Chunk) -> dict:
        return self._envelope("chat.completion.chunk", [], _usage(last))


def _tool_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritone-openai",
                                description="OpenAI-compatible API (completions, chat) in front of Tritone's ensemble.")
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address (default 127.0.0.1:8001)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind to (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model-name", default="ensemble",
                   help="the model name clients send and /v1/models lists (scripts/serve: the model directory's name)")
    p.add_argument("--api-key", default=os.environ.get("TRITONE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TRITONE_API_KEY; none: open)")
    p.add_argument("--tool-call-parser", default="hermes", choices=PARSERS,
                   help="the model's tool-call syntax (default hermes: <tool_call> blocks, as Qwen 2.5 / 3 write "
                        "them; llama3_json: Llama 3.x JSON); scripts/serve picks it from the chat template")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"refuse a request body larger than this with 413, before reading it "
                        f"(default {DEFAULT_MAX_BODY_BYTES}: 4 MiB)")
    p.add_argument("--log-level", default="warning")
    return p


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="tritone-openai: %(message)s")
    # The control key by environment only, out of the process list.
    server = OpenAIServer(args.grpc_url, args.model_name, args.api_key, args.tool_call_parser,
                          max_body_bytes=args.max_body_bytes,
                          control_key=os.environ.get("TRITONE_CONTROL_KEY") or None)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
