"""The engine's threads: one steps an LLMEngine, another sends its outputs, and callers submit and
abort from any thread through an inbox."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tritone.config import text_nice
from tritone.engine.core import LLMEngine
from tritone.executor.multiproc import WorkerDied
from tritone.processes import lower_thread_priority
from tritone.scheduling.request import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str
    reason: FinishReason = FinishReason.CANCELLED
    error: str | None = None


@dataclass(slots=True)
class _Flushed:
    """Put in the outbox behind a dying engine's last outputs: set once they have been sent."""

    event: threading.Event = field(default_factory=threading.Event)


# Errors a CUDA context does not come back from (torch raises them as AcceleratorError, or, in
# older paths, as a RuntimeError with the driver's text).
_FATAL_DEVICE_TEXT = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "NCCL error", "illegal memory access",
                      "device-side assert")


class DeviceLost(RuntimeError):
    """The device failed in a way this process cannot recover from."""


def is_device_fatal(exc: BaseException) -> bool:
    """Whether `exc` leaves the device unusable for this process."""
    if type(exc).__name__ == "AcceleratorError":
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _FATAL_DEVICE_TEXT)


class AsyncEngine:
    """Runs an LLMEngine in its own thread: callers submit and abort from any thread, and
    outputs go to `on_output` from a separate sender thread, so sending never holds up a step.

    Every request gets exactly one final output. A failed step, add or abort fails the requests
    the engine holds and the engine goes on; where a model worker process died (tensor or data
    parallelism), the engine is built again, new workers and all, before it goes on. If a thread dies all the same (the failure path
    itself failed), the engine is dead: `submit` refuses, every request it held is failed, and
    `on_fatal(message)` is called, which the llm model answers by ending its process, so that
    the launcher restarts the server as it does for any dead model process."""

    # Built by `build()` on the engine thread, before the constructor returns.
    engine: LLMEngine

    def __init__(self, build: Callable[[], LLMEngine], on_output: Callable[[RequestOutput], None],
                 on_fatal: Callable[[str], None] = lambda message: None):
        """Builds the engine with `build()` on the thread that then runs it, and starts both
        threads; raises what `build` raised.

        OpenMP keeps a team of worker threads for each thread that runs parallel work. Loading
        and warming up the model on the caller's thread and stepping it on another would leave
        two teams, more OpenMP threads than cores, and libgomp then parks its workers after
        almost every parallel region instead of letting them spin."""
        self.on_output, self.on_fatal, self._build = on_output, on_fatal, build
        self.num_restarts = 0
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        # Held while submitting and while the engine is declared dead, so that no request slips
        # into the inbox of a dead engine unanswered.
        self._lock = threading.Lock()
        # Why the engine is dead; None while it is alive.
        self.dead: str | None = None
        # Requests whose final error the sender sent after a failed send (sender thread only).
        self._failed: set[str] = set()
        # Submitted (caller's thread) and added (engine thread), each counted by its own thread only:
        # requests still in the inbox count against the queue limit, or a burst would slip past it.
        self._num_submitted = 0
        self._num_added = 0
        failure: list[BaseException] = []
        ready = threading.Event()

        def run():
            try:
                self.engine = build()
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            self._engine_loop()

        self._engine_thread = threading.Thread(target=run, name="tritone-engine", daemon=True)
        self._engine_thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        self._sender_thread = threading.Thread(target=self._sender_loop, name="tritone-sender", daemon=True)
        self._sender_thread.start()

    @property
    def num_steps(self) -> int:
        return self.engine.stats.num_steps

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._engine_thread.is_alive() and self._sender_thread.is_alive()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validates at once (raising ValueError naming the field), the one check of the request,
        and enqueues; raises RuntimeError when the engine is dead."""
        self.engine.validate(prompt_ids, params, num_queued=self._num_submitted - self._num_added)
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(f"the engine is not running ({self.dead}); the server restarts, retry later")
            self._num_submitted += 1
            self._inbox.put(_Submit(request_id, prompt_ids, params))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        self._inbox.put(_Abort(request_id, reason, error))

    def stop(self, timeout: float = 30.0) -> None:
        """Lets in-flight requests finish for up to `timeout` seconds, then cancels the rest."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() and self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._inbox.put(None)
        self._engine_thread.join()
        self._outbox.put(None)
        self._sender_thread.join()
        self.engine.shutdown()

    def _engine_loop(self) -> None:
        try:
            while self._engine_iteration():
                pass
            outputs = [self.engine.abort_request(request_id) for request_id in list(self.engine.scheduler.requests)]
            self._outbox.put(outputs + self._refuse_inbox("the engine stopped before it took the request in"))
        except BaseException as exc:
            logger.exception("the engine thread died")
            self._die(str(exc) if isinstance(exc, DeviceLost) else f"engine thread died: {exc!r}", send=True)

    def _engine_iteration(self) -> bool:
        """One drain of the inbox and one step; False once asked to stop."""
        try:
            if not self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                return False
            outputs = self.engine.step()
        except WorkerDied as exc:
            self._outbox.put(self._fail_all(f"engine error: {exc}"))
            self._restart()
            return True
        except Exception as exc:  # a failed step fails its requests, not the server
            logger.exception("engine step failed")
            if is_device_fatal(exc):
                # A CUDA error such as an illegal address is sticky: every later step on this
                # context fails too. Only a new process recovers, so the engine dies (the llm model
                # then ends its process and the launcher restarts the server).
                raise DeviceLost(f"device error, the process must restart: {exc}") from exc
            outputs = self._fail_all(f"engine error: {exc}")
        if outputs:
            self._outbox.put(outputs)
        return True

    def _drain_inbox(self, block: bool) -> bool:
        try:
            if block:
                t0 = time.perf_counter()
                try:
                    item = self._inbox.get()
                finally:
                    self.engine.stats.idle_seconds += time.perf_counter() - t0
            else:
                item = self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                self._apply(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, item) -> None:
        if isinstance(item, _Abort):
            output = self.engine.abort_request(item.request_id, item.reason, item.error)
            if output is not None:
                self._outbox.put([output])
            return
        self._num_added += 1
        try:
            self.engine.add_request(item.request_id, item.prompt_ids, item.params, validated=True)
        except (ValueError, RuntimeError) as exc:  # refused: nothing of it entered the engine
            self._outbox.put([_error_output(item, str(exc))])
        except Exception as exc:
            logger.exception("adding request %s failed", item.request_id)
            output = self.engine.abort_request(item.request_id, FinishReason.ERROR, f"engine error: {exc}")
            self._outbox.put([output or _error_output(item, f"engine error: {exc}")])

    def _restart(self) -> None:
        """A new engine in place of one whose model workers died: its requests have all ended, and
        its KV cache (prefix cache included) died with them. Requests submitted meanwhile wait in
        the inbox; if the new engine cannot start, the engine thread dies (see _engine_loop)."""
        t0 = time.perf_counter()
        logger.error("a model worker died: restarting the engine")
        self.engine.shutdown()
        self.engine = self._build()
        self.num_restarts += 1
        logger.warning("engine restarted in %.1f s (restart %d)", time.perf_counter() - t0, self.num_restarts)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outputs = [self.engine.abort_request(request_id, FinishReason.ERROR, message)
                   for request_id in list(self.engine.scheduler.requests)]
        self.engine.drop_in_flight()
        return outputs

    def _die(self, message: str, send: bool) -> None:
        """Fails every request the engine holds or has not yet taken in, without trusting the
        engine's state; `send`: the sender still works, so wait (a little) for them to go out."""
        with self._lock:
            self.dead = message
        outputs = []
        for request in list(self.engine.scheduler.requests.values()):
            try:
                self.engine.scheduler.finish(request, FinishReason.ERROR)
            except Exception:
                logger.exception("freeing the blocks of request %s failed", request.request_id)
            outputs.append(RequestOutput(request.request_id, [], [], request.num_prompt_tokens,
                                         request.num_output_tokens, True, FinishReason.ERROR, error=message))
        self.engine.scheduler.requests.clear()
        outputs += self._refuse_inbox(message)
        if send:
            flushed = _Flushed()
            self._outbox.put(outputs)
            self._outbox.put(flushed)
            flushed.event.wait(timeout=10.0)
        self.on_fatal(message)

    def _refuse_inbox(self, message: str) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if isinstance(item, _Submit):
                outputs.append(_error_output(item, message))

    def _sender_loop(self) -> None:
        try:
            self._lower_sender_priority()
            self._send_until_stopped()
        except BaseException as exc:
            logger.exception("the sender thread died")
            # Nothing can be sent any more: the requests end when the model's process does.
            self._die(f"sender thread died: {exc!r}", send=False)

    def _lower_sender_priority(self) -> None:
        """On the CPU the sender's work (text, and a round trip to tritonserver per response)
        preempts the forward's threads, which then wait for each other; nicer, it runs in their
        gaps (config.text_nice)."""
        # The launcher renders a number; auto only where the engine was started some other way.
        nice = text_nice(self.engine.config.text_nice, "ensemble")
        device = getattr(getattr(self.engine, "runner", None), "device", None)
        if nice and getattr(device, "type", None) == "cpu":
            tid = threading.get_native_id()
            try:
                lower_thread_priority(tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
            except OSError as exc:
                logger.warning("could not lower the response sender's priority: %s", exc)

    def _send_until_stopped(self) -> None:
        stopping = False
        while not stopping:
            outputs = self._outbox.get()
            if outputs is None:
                return
            if isinstance(outputs, _Flushed):
                outputs.event.set()
                continue
            outputs = list(outputs)
            flushed = []
            # Steps that finished while the last responses went out are sent together: one
            # response per request however many steps it spans, so when sending falls behind
            # the engine, it catches up instead of falling further behind.
            while True:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                if isinstance(more, _Flushed):
                    flushed.append(more)
                    continue
                outputs.extend(more)
            t0 = time.perf_counter()
            for output in merge_outputs(outputs):
                self._send(output)
            self.engine.stats.phase_seconds["send"] += time.perf_counter() - t0
            for item in flushed:
                item.event.set()

    def _send(self, output: RequestOutput) -> None:
        """Sends one output. When that fails, the request's final output is an error sent at
        once, and the engine ends the request (freeing its blocks) after: what it still sends
        for the request, up to and including its own final output, is dropped here."""
        if output.request_id in self._failed:
            if output.finished:
                self._failed.discard(output.request_id)
            return
        try:
            self.on_output(output)
            return
        except Exception as exc:
            logger.exception("sending output of request %s failed", output.request_id)
            message = f"sending a response failed: {exc}"
        if not output.finished:
            self._failed.add(output.request_id)
            self.abort(output.request_id, FinishReason.ERROR, message)
        try:
            self.on_output(dataclasses.replace(output, new_token_ids=[], new_log_probs=[], finished=True,
                                               finish_reason=FinishReason.ERROR, error=message))
        except Exception:
            logger.exception("request %s could not be sent its final error either", output.request_id)


def _error_output(item: _Submit, message: str) -> RequestOutput:
    return RequestOutput(item.request_id, [], [], len(item.prompt_ids), 0, True, FinishReason.ERROR, error=message)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Joins each request's consecutive outputs into one, in order of first appearance."""
    merged: dict[str, RequestOutput] = {}
    for output in outputs:
        prev = merged.get(output.request_id)
        if prev is None:
            merged[output.request_id] = output
            continue
        # Every per-token list joins; the prompt's scores come with the first output alone.
        top = None if prev.new_top_log_probs is None and output.new_top_log_probs is None else \
            (prev.new_top_log_probs or []) + (output.new_top_log_probs or [])
        merged[output.request_id] = dataclasses.replace(
            output, new_token_ids=prev.new_token_ids + output.new_token_ids,
            new_log_probs=prev.new_log_probs + output.new_log_probs, new_top_log_probs=top,
            prompt_top_log_probs=prev.prompt_top_log_probs or output.prompt_top_log_probs)
    return list(merged.values())
