"""The front end's side of tritonserver: the `ensemble` over gRPC streaming on one shared channel.

Every request goes out with its own Triton request id, the OpenAI id of its answer. When a client
goes away before the end, the front end tells the `llm` model directly to abort that id (an
ABORT_REQUEST_ID control request) and reads the stream on to its end (Generation.abort): Triton
2.51 does not pass a cancellation into the ensemble's running llm step, the direct word reaches a
request still waiting for the engine or in a long prefill, and a cancelled ensemble request would
stay counted in flight. Only where that fails is the gRPC stream cancelled (Generation.close). The
llm model obeys a control request only with the server's secret (CONTROL_KEY).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import numpy as np

from tritone_client.client import Chunk, infer_inputs, read_grpc_chunk

from tritone.openai.errors import Failure, RequestError, failed, triton_error

logger = logging.getLogger("tritone.openai")
ENSEMBLE = "ensemble"
# How long an abort sent to the engine may take before the front end gives up on it.
ABORT_TIMEOUT_SECONDS = 5.0


class Backend:
    """The ensemble over one gRPC channel, shared by every request."""

    def __init__(self, url: str, control_key: str | None = None, sends_aborts: bool = True):
        import tritonclient.grpc.aio as grpcaio

        self._grpcaio = grpcaio
        self.client = grpcaio.InferenceServerClient(url)
        # The llm model's secret for control requests; without it an abort is refused.
        self.control_key = control_key
        # False where the model behind "ensemble" is the engine's own (llm_inline): it sees the
        # gRPC stream cancelled, and there is no llm model to send an abort to.
        self.sends_aborts = sends_aborts
        self.aborts: set[asyncio.Task] = set()

    def _inputs(self, tensors: dict[str, np.ndarray]) -> list:
        return infer_inputs(self._grpcaio, tensors.items())

    def generate(self, request_id: str, tensors: dict[str, np.ndarray], guide_field: str | None = None,
                 echo: "Echo | None" = None) -> "Generation":
        """The ensemble's responses to one request, as a Generation; `guide_field` names the
        OpenAI field of its output constraint in the engine's errors about it; `echo` puts the
        prompt before the answer."""
        inputs = self._inputs(tensors)

        async def requests():
            yield {"model_name": ENSEMBLE, "inputs": inputs, "request_id": request_id}

        return Generation(self, request_id, self.client.stream_infer(requests()), guide_field, echo)

    def _abort_later(self, request_id: str) -> None:
        if not self.sends_aborts:
            return
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
            await asyncio.wait_for(send(), ABORT_TIMEOUT_SECONDS)
        except Exception as exc:  # the client is gone; the request still ends at max_tokens
            logger.warning("abort of %s failed: %r", request_id, exc)

    async def close(self) -> None:
        """Lets the aborts under way reach the engine, then closes the channel."""
        if self.aborts:
            await asyncio.wait(self.aborts, timeout=ABORT_TIMEOUT_SECONDS)
        await self.client.close()


class Generation:
    """Iterates over one request's chunks; raises RequestError for an error response. close()
    before the last response cancels the gRPC stream and aborts the request in the engine. It
    does not wait, so that it also works from code that is being cancelled (a client's
    disconnect cancels the response's task)."""

    def __init__(self, backend: Backend, request_id: str, stream, guide_field: str | None = None,
                 echo: "Echo | None" = None):
        self.backend, self.request_id, self.stream = backend, request_id, stream
        self.guide_field, self.echo = guide_field, echo
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
            raise triton_error(error.message() if hasattr(error, "message") else str(error), self.guide_field)
        chunk = read_grpc_chunk(result)
        # No prompt has zero tokens: a zero is a response without the count.
        chunk.num_input_tokens = self.num_input_tokens = chunk.num_input_tokens or self.num_input_tokens
        self.is_answered = self.is_answered or bool(chunk.finish_reason)
        return chunk if self.echo is None else self.echo.apply(chunk)

    def _failed(self, exc: Exception) -> RequestError:
        """grpc.aio raises a failed call (a server that cannot be reached, or went away) rather
        than answering with an error response; its status code says which."""
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        if code == grpc.StatusCode.UNAVAILABLE:
            self.is_answered = True  # nothing there to abort
            return failed(Failure.UNAVAILABLE, f"{code} {exc.details()}")
        return failed(Failure.ENGINE_FAILED, f"the gRPC stream of {self.request_id} failed: {exc!r}")

    async def whole(self) -> Chunk:
        """The whole answer, joined from its chunks."""
        whole = Chunk("", 0, 0, 0.0, [], "")
        async for chunk in self:
            whole.text += chunk.text
            whole.output_log_probs += chunk.output_log_probs
            whole.top_log_probs += chunk.top_log_probs
            whole.num_input_tokens, whole.num_output_tokens = chunk.num_input_tokens, chunk.num_output_tokens
            whole.cum_log_prob = chunk.cum_log_prob
            whole.finish_reason = chunk.finish_reason or whole.finish_reason
        return whole

    async def read_to_end(self) -> None:
        async for _ in self:
            pass

    def abort(self) -> bool:
        """Its client left: tells the engine to end the request, whose last responses the caller
        then reads to the end of the stream, rather than cancelling the stream (Triton 2.51 counts
        a cancelled ensemble request in flight for good: its next postprocessing step is refused
        while the llm step still runs). False where only a cancelled stream reaches the engine
        (llm_inline): close() does that."""
        if self.is_answered:
            return True
        if not self.backend.sends_aborts:
            return False
        self.backend._abort_later(self.request_id)
        return True

    def close(self) -> None:
        if not self.is_answered:
            self.is_answered = True
            self.stream.cancel()
            self.backend._abort_later(self.request_id)


@dataclass(slots=True)
class Echo:
    """A completion's `echo`: the prompt's text (and, with logprobs, its tokens' scores) before
    the first chunk's; with max_tokens 0 the one token generated for the scores is dropped, so
    the answer is the prompt alone, finished for length as vLLM's."""

    # None for a prompt of token ids: its tokens' texts, from the prompt's scores.
    prompt: str | None
    keep_output: bool = True
    is_started: bool = False

    def apply(self, chunk: Chunk) -> Chunk:
        if not self.keep_output:
            chunk.text, chunk.output_log_probs, chunk.top_log_probs = "", [], []
            chunk.num_output_tokens, chunk.cum_log_prob = 0, 0.0
            if chunk.finish_reason == "stop":  # the dropped token's end: the answer stopped at its length
                chunk.finish_reason = "length"
        if not self.is_started:
            self.is_started = True
            prompt = self.prompt if self.prompt is not None else "".join(t[0] for t in chunk.prompt_log_probs)
            chunk.text = prompt + chunk.text
            chunk.top_log_probs = chunk.prompt_log_probs + chunk.top_log_probs
        return chunk
