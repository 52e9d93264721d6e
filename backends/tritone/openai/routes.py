"""tritone-openai's HTTP routes: OpenAI's completions, chat completions and models, behind the
guard, over one Backend.

Nothing of the server's own reaches a client: a refusal names the client's field, and a failure
on the server's side is a generic message (the detail goes to the log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import numpy as np

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from tritone_client.client import Chunk

from tritone.openai import choices
from tritone.openai.backend import Backend, Echo, Generation
from tritone.openai.errors import RequestError, error_body
from tritone.openai.formats import ChatFormat, CompletionFormat, ResponseFormat, sse
from tritone.openai.guard import DEFAULT_MAX_BODY_BYTES, Guard
from tritone.openai.guides import constrain_after_reasoning
from tritone.openai.protocol import ChatCompletionRequest, CompletionRequest
from tritone.openai.tools import ToolStream
from tritone.text.reasoning import ReasoningStream

logger = logging.getLogger("tritone.openai")


# How long the rest of a request whose client left may take to end once the engine has been told
# to abort it (Generation.abort), before its gRPC stream is cancelled instead.
DRAIN_SECONDS = 10.0


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events of `generations`. Where the client leaves, Starlette's own response
    cancels the task that writes the events, and with it the gRPC read under way, which grpc.aio
    answers by cancelling the call; this one has the engine end the generations and lets the
    events run to their end (uvicorn drops what is sent to a client that has gone), cancelling
    only where that fails or takes longer than DRAIN_SECONDS."""

    def __init__(self, content, generations: list[Generation]):
        super().__init__(content, media_type="text/event-stream")
        self.generations = generations

    async def __call__(self, scope, receive, send):
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
            if not streaming.done() and all([g.abort() for g in self.generations]):
                await asyncio.wait({streaming}, timeout=DRAIN_SECONDS)
        finally:
            listening.cancel()
            streaming.cancel()  # still running: the events' generator closes its generations
        if not streaming.cancelled():
            streaming.result()


class OpenAIServer:
    """The routes, for one served model name, over one Backend."""

    def __init__(self, backend_url: str, model_name: str, api_key: str | None = None, tool_parser: str = "hermes",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, control_key: str | None = None,
                 reasoning_parser: str | None = None, adapters: list[str] = (), sends_aborts: bool = True):
        """`adapters`: the LoRA adapters' names, in the server's order (lora_task_id 1, 2, ...);
        `sends_aborts`: a request whose client leaves is aborted in the llm model (the ensemble)."""
        self.backend_url, self.model_name, self.api_key = backend_url, model_name, api_key
        self.adapters = list(adapters)
        self.tool_parser, self.control_key, self.sends_aborts = tool_parser, control_key, sends_aborts
        # Chat answers are split into reasoning_content and content by it (None: not split).
        self.reasoning_parser = reasoning_parser
        self.backend: Backend | None = None
        self.created = int(time.time())
        # No generated docs: they would describe the server to anyone who asks, key or not.
        self.app = FastAPI(title="tritone-openai", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                           openapi_url=None)
        self.app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
        _error_handlers(self.app)
        self._routes()

    async def _lifespan(self, app):
        if self.sends_aborts and not self.control_key:
            logger.warning("TRITONE_CONTROL_KEY is not set: aborts of requests whose clients leave cannot reach "
                           "the engine (they run on to max_tokens); set it to the server's control key")
        self.backend = Backend(self.backend_url, self.control_key, self.sends_aborts)
        yield
        await self.backend.close()

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card(name) for name in [self.model_name, *self.adapters]]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            self._lora_id(name)
            return self._model_card(name)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._serve(body, request, "cmpl", CompletionFormat)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            return await self._serve(body, request, "chatcmpl", ChatFormat)

    def _model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "tritone"}
        if name != self.model_name:  # an adapter, as vLLM lists them
            card |= {"root": name, "parent": self.model_name}
        return card

    def _lora_id(self, name: str) -> int:
        """The adapter a model name picks (0: the base model); 404 for a name not served."""
        if name == self.model_name:
            return 0
        if name in self.adapters:
            return self.adapters.index(name) + 1
        served = ", ".join(repr(n) for n in [self.model_name, *self.adapters])
        raise RequestError(f"model {name!r} does not exist: this server serves {served}", "model",
                           status=404, type="not_found_error")

    async def _serve(self, body, request: Request, prefix: str, format_cls: type[ResponseFormat]):
        lora_id = self._lora_id(body.model)
        body.check_supported()
        calls_tools = getattr(body, "calls_tools", False)
        fmt = format_cls(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), self.model_name, body.wants_logprobs,
                         self.tool_parser if calls_tools else None,
                         reasoning_parser=self.reasoning_parser if format_cls is ChatFormat else None)
        guide = body.guide()
        guide_field = "tools" if calls_tools else guide and guide[0]
        prompts = body.prompts if isinstance(body, CompletionRequest) else [None]
        choice_inputs = [self._inputs(body, fmt, calls_tools, guide, p, i, lora_id)
                         for p in prompts for i in range(body.num_seqs)]
        if len(choice_inputs) > 1:
            if body.stream and (calls_tools or fmt.reasoning_parser):
                raise RequestError("a stream of several choices cannot be parsed for tool calls or reasoning: "
                                   "set n to 1 or stream to false", "n")
            echoes = [_echo(body, p) for p in prompts for _ in range(body.num_seqs)]
            return await self._serve_choices(body, request, fmt, choice_inputs, guide_field, echoes)
        chunks = self.backend.generate(fmt.id, choice_inputs[0], guide_field, _echo(body, prompts[0]))
        try:
            if not body.stream:
                return fmt.whole(await _unless_gone(request, chunks.whole(), [chunks]))
            # The first response decides the status: an error before any token is an HTTP error.
            first = await _unless_gone(request, chunks.__anext__(), [chunks])
        except StopAsyncIteration:
            raise RequestError("the server ended the stream without an answer", status=500, type="server_error")
        except BaseException:
            chunks.close()
            raise
        return EventStream(_events(fmt, first, chunks, body.include_usage, body.continuous_usage), [chunks])

    def _inputs(self, body, fmt: ResponseFormat, calls_tools: bool, guide, prompt: str | None, index: int,
                lora_id: int = 0) -> dict:
        """The ensemble inputs of one sequence: the `index`th of its prompt (its own seed), with the
        adapter its model name picks."""
        inputs = body.ensemble_inputs(prompt, index) if prompt is not None else body.ensemble_inputs(index=index)
        if lora_id:
            inputs["lora_task_id"] = np.array([[lora_id]], dtype=np.uint64)
        if calls_tools:
            body.tool_inputs(inputs, self.tool_parser)
        if fmt.reasoning_parser and "guided_decoding_guide_type" in inputs:
            constrain_after_reasoning(inputs, fmt.reasoning_parser, "tools" if calls_tools else guide[0])
        return inputs

    async def _serve_choices(self, body, request: Request, fmt: ResponseFormat, choice_inputs: list[dict],
                             guide_field: str | None, echoes: list[Echo | None]):
        """Several sequences (prompts, n, best_of): one generation each, submitted together, so
        that the engine batches them and prefix caching shares their prompt's full blocks once
        the first has computed them; the choices keep the prompts' order, then the sequences'."""
        generations = [self.backend.generate(f"{fmt.id}-{i}", inputs, guide_field, echo)
                       for i, (inputs, echo) in enumerate(zip(choice_inputs, echoes))]
        if not body.stream:
            answers = await _unless_gone(request, choices.wholes(generations), generations)
            usage = choices.total(answers, body.num_seqs)
            return fmt.wholes(choices.best(answers, body.num_seqs, body.n), usage)
        firsts = await _unless_gone(request, choices.firsts(generations), generations)
        return EventStream(choices.events(fmt, firsts, generations, body.include_usage, body.continuous_usage,
                                          body.num_seqs), generations)


def _echo(body, prompt: str | list[int] | None) -> Echo | None:
    """A completion's echo of `prompt` (None for chat, or without echo)."""
    if not getattr(body, "echo", False):
        return None
    return Echo(prompt if isinstance(prompt, str) else None, keep_output=body.max_tokens != 0)


async def _events(fmt: ResponseFormat, first: Chunk, chunks: Generation, include_usage: bool,
                  continuous_usage: bool):
    # On a client's disconnect the engine ends the request and this runs on to the end (EventStream);
    # if that fails, this generator's task is cancelled and close() cancels the gRPC stream.
    last = first
    tools = ToolStream(fmt.tool_parser) if fmt.tool_parser else None
    reasoning = ReasoningStream(fmt.reasoning_parser) if fmt.reasoning_parser else None
    try:
        yield sse(fmt.start(include_usage))
        chunk = first
        while True:
            last = chunk
            thought = ""
            if reasoning is not None:  # from here on the chunk's text is its content only
                thought, chunk = _reasoning_piece(reasoning, chunk)
            if tools is not None:
                chunk = dataclasses.replace(chunk, text=tools.feed(chunk.text))
                if chunk.finish_reason:
                    rest, calls = tools.finish()
                    chunk.text += rest
                    if calls:
                        if chunk.text or thought:
                            rest = dataclasses.replace(chunk, finish_reason="", output_log_probs=[], top_log_probs=[])
                            yield sse(fmt.delta(rest, include_usage, reasoning=thought))
                            thought = ""
                        yield sse(fmt.tool_delta(calls, include_usage))
                        chunk = dataclasses.replace(chunk, text="")
            if chunk.text or thought or chunk.top_log_probs or chunk.finish_reason:
                yield sse(fmt.delta(chunk, include_usage, continuous_usage, reasoning=thought))
            if chunk.finish_reason:
                break
            chunk = await chunks.__anext__()
        await chunks.read_to_end()
        if include_usage:
            yield sse(fmt.usage(last))
    except RequestError as exc:  # after the first response: reported in the stream
        yield sse(error_body(exc.message, exc.type, exc.param))
    except StopAsyncIteration:
        pass
    finally:
        chunks.close()
    yield sse("[DONE]")


def _reasoning_piece(stream: ReasoningStream, chunk: Chunk) -> tuple[str, Chunk]:
    """(the chunk's reasoning piece, the chunk with its content piece as its text); what the
    stream held back comes out with the final chunk."""
    thought, text = stream.feed(chunk.text)
    if chunk.finish_reason:
        rest_thought, rest_text = stream.finish()
        thought, text = thought + rest_thought, text + rest_text
    return thought, dataclasses.replace(chunk, text=text)


async def _unless_gone(request: Request, awaitable, generations: list[Generation], poll_seconds: float = 0.2):
    """The awaitable's result (a read of `generations`), unless the client disconnects first
    (ClientGone): then the engine ends the generations, which are read to their ends, as
    EventStream does. Starlette notices a disconnect by itself only once a streamed body is being
    sent; before that (a request waiting in the engine's queue, a long prefill, a whole answer) it
    is looked for here."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_seconds)
            if done:
                return task.result()
            if await request.is_disconnected():
                if all([g.abort() for g in generations]):
                    drain = asyncio.ensure_future(_read_to_ends(task, generations))
                    if not (await asyncio.wait({drain}, timeout=DRAIN_SECONDS))[0]:
                        drain.cancel()
                raise ClientGone()
    finally:
        task.cancel()  # still reading: the caller's close() cancels the gRPC stream


async def _read_to_ends(task: asyncio.Future, generations: list[Generation]) -> None:
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: what the client would have been told goes nowhere now
    for generation in generations:
        try:
            await generation.read_to_end()
        except Exception:
            pass


def _error_handlers(app: FastAPI) -> None:
    """Every refusal and failure in OpenAI's error JSON."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            position = (first.get("loc") or ("body", "?"))[-1]
            message = f"the body is not valid JSON: {(first.get('ctx') or {}).get('error', first.get('msg'))} " \
                      f"(at character {position})"
            return _error_response(RequestError(message))
        param = _param(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            message = f"{param} is not a supported parameter"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error_response(RequestError(message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        # Starlette's own refusals (no such route, a wrong method, a body that is not JSON text)
        # in OpenAI's shape.
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
        return _error_response(exc)


def _error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)


def _param(loc) -> str | None:
    """The field a validation error's location names, as the client wrote it: messages[0].role."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None
