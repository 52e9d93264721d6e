"""The engine's side of a decoupled Triton model (`llm`, `llm_inline`), without importing Triton.

Both models register each request's response sender here, hand the engine's outputs back
through it, send each request exactly one final response, and stop the requests whose clients
went away. Triton's utilities module comes in as `pb_utils`, so the whole protocol is tested
with a fake one (tests/test_frontend.py); the adapters only parse tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from typing import Callable

import numpy as np

from tritone.config import EngineConfig
from tritone.engine.async_engine import AsyncEngine
from tritone.engine.core import LLMEngine
from tritone.engine.data_parallel import DataParallelEngine
from tritone.scheduling.request import FinishReason, RequestOutput
from tritone.serving.flow import NUM_SLOTS, FlowBoard, new_key
from tritone.serving.inputs import LLMRequest
from tritone.serving.lifecycle import end_process
from tritone.serving.responses import ResponseStream, error_message
from tritone.text import Detokenizer

# How often client cancellations may be looked for: once a step, but no more than every 0.1 s,
# since each look at a direct caller's stream is an is_cancelled() round trip to the server (at
# 20 ms, the tiny model's steps at concurrency 256 asked thousands of times a second); the flow
# board, which tells of the ensemble's cancelled streams, is a read of shared memory, looked at
# every 0.05 s. Metrics every 0.25 s, so that the KV gauges trail the engine by a quarter second
# at most: the cancellation tests read them.
CANCEL_POLL_SECONDS = 0.1
FLOW_POLL_SECONDS = 0.05
METRICS_SECONDS = 0.25
# An abort may arrive before its request (a client that leaves while its prompt is tokenized):
# it is kept this long, and at most this many, to meet the request.
EARLY_ABORT_SECONDS = 60.0
MAX_EARLY_ABORTS = 4096

Tensors = dict[str, np.ndarray]


class EngineFrontend:
    """The streams of one engine and the protocol of their responses.

    Triton frees a request's response factory once its final response is sent, and asking a
    freed one whether it was cancelled crashes the server: `final_lock` keeps the two apart.
    """

    def __init__(self, pb_utils, detokenizer: Detokenizer, stream_interval: int = 1,
                 flow: FlowBoard | None = None, outputs: Callable[[Tensors], Tensors] = lambda tensors: tensors):
        self.pb, self.detokenizer, self.stream_interval = pb_utils, detokenizer, stream_interval
        # `outputs` turns a ResponseStream's tensors into the model's outputs (llm_inline detokenizes).
        self.flow, self.outputs = flow, outputs
        # Engine request id -> its stream, the Triton request's sender, its Triton id, and the
        # engine ids of its request's sequences still running (num_return_sequences; shared).
        self.streams: dict[str, tuple[ResponseStream, object, str | None, list[str]]] = {}
        self.final_lock = threading.Lock()
        # The engine's ids of requests: internal, never in a response.
        self.ids, self.sends = itertools.count(), itertools.count()
        # Flow-board slots of streams not running (slot 0 never: an unset key reads as 0).
        self.free_slots = list(range(NUM_SLOTS - 1, 0, -1))
        self.early_aborts: dict[str, float] = {}
        self.stopping = threading.Event()
        self.engine: AsyncEngine | DataParallelEngine | None = None

    def launch(self, config: EngineConfig, make_metrics: Callable[[list[AsyncEngine]], object] | None = None) -> None:
        """Starts the engine, or the data-parallel engines (each one's thread builds its model, and
        this waits for them), and the watchers; `make_metrics(engines)` gives what reports their
        metrics."""
        if config.data_parallel_size == 1:
            self.engine = AsyncEngine(lambda: LLMEngine(config), self.send, on_fatal=end_process)
            engines = [self.engine]
        else:
            self.engine = DataParallelEngine([functools.partial(LLMEngine, config, i)
                                              for i in range(config.data_parallel_size)], self.send, end_process)
            engines = self.engine.engines
        threading.Thread(target=self.watch_cancellations, name="tritone-cancellations", daemon=True).start()
        if make_metrics is not None:
            metrics = make_metrics(engines)
            threading.Thread(target=self._report_metrics, args=(metrics,), name="tritone-metrics", daemon=True).start()

    @property
    def is_idle(self) -> bool:
        return not self.streams

    def submit(self, sender, request: LLMRequest | Exception, triton_id: str | None = None) -> None:
        """Starts a parsed request (its num_return_sequences engine requests), or answers a request
        that failed to parse (or that the engine refuses) with one final error response naming
        the field."""
        sequences: list[str] = []
        try:
            if isinstance(request, Exception):
                raise request
            n = request.num_return_sequences
            for i in range(n):
                request_id = str(next(self.ids))
                params = request.params
                if n > 1 and params.seed is not None:  # sequence i draws from seed + i
                    params = dataclasses.replace(params, seed=(params.seed + i) % (1 << 63))
                flow = self.flow if request.flow_control and self.free_slots else None
                key = new_key(self.free_slots.pop()) if flow is not None else 0
                if flow is not None:
                    flow.register(key)
                stream = ResponseStream(request, self.detokenizer, self.stream_interval, key=key, flow=flow,
                                        sends=self.sends, sequence_index=i if n > 1 else None)
                sequences.append(request_id)
                self.streams[request_id] = (stream, sender, triton_id, sequences)
                self.engine.submit(request_id, request.prompt_ids, params)
            aborted_at = self.early_aborts.pop(triton_id, None) if triton_id else None
            if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_SECONDS:
                for request_id in sequences:
                    self.engine.abort(request_id)
        except (ValueError, RuntimeError) as exc:
            with self.final_lock:
                for request_id in sequences:  # those submitted before one was refused end unanswered
                    self.engine.abort(request_id)
                    self._forget(request_id)
                self._send_final(sender, self._error(str(exc)))

    def send(self, output: RequestOutput) -> None:
        """The engine's sender thread: the response for one engine output, if any."""
        entry = self.streams.get(output.request_id)
        if entry is None:  # the engine's outputs after a stop word already ended the stream
            return
        stream, sender, _, sequences = entry
        message = error_message(output)
        if message is not None and not stream.request.flow_control:
            response = self._error(message)
        else:
            # The ensemble's streams fail in band, through postprocessing (ResponseStream.failed).
            tensors = stream.on_output(output) if message is None else stream.failed(message)
            if tensors is None:
                return
            response = self.pb.InferenceResponse([self.pb.Tensor(n, a[None]) for n, a in self.outputs(tensors).items()])
            if stream.is_finished and not output.finished:
                self.engine.abort(output.request_id, FinishReason.STOP)
        if not (output.finished or stream.is_finished):
            sender.send(response)
            return
        with self.final_lock:
            if message is not None:  # the last try: the engine's sender sends nothing after it
                for request_id in list(sequences):  # an error ends the whole request, every sequence
                    if request_id != output.request_id:
                        self.engine.abort(request_id)
                    self._forget(request_id)
            elif len(sequences) > 1:  # another sequence still runs: this one ends without the final flag
                sender.send(response)
                self._forget(output.request_id)
                return
            self._send_final(sender, response)  # if it raises, the engine's sender sends an error
            self._forget(output.request_id)

    def _forget(self, request_id: str) -> None:
        entry = self.streams.pop(request_id, None)
        if entry is not None and request_id in entry[3]:
            entry[3].remove(request_id)
        if entry is not None and entry[0].flow is not None:
            entry[0].flow.release(entry[0].key)
            self.free_slots.append(entry[0].key & (NUM_SLOTS - 1))

    def abort(self, triton_id: str) -> None:
        """Stops the requests of this Triton request id. Finished ones are ignored (aborts race
        with the ends of requests); one not here yet is remembered for a while, to meet it."""
        ids = [i for i, e in list(self.streams.items()) if e[2] == triton_id]  # every sequence
        for request_id in ids:
            self.engine.abort(request_id)
        if not ids:
            now = time.monotonic()
            if len(self.early_aborts) >= MAX_EARLY_ABORTS:
                self.early_aborts = {t: at for t, at in self.early_aborts.items() if now - at < EARLY_ABORT_SECONDS}
            if len(self.early_aborts) < MAX_EARLY_ABORTS:
                self.early_aborts[triton_id] = now

    def watch_cancellations(self) -> None:
        # The engine answers an abort with a final "cancelled" output, which closes the stream;
        # until then the response factory stays alive and unload waits.
        last_step, last_poll = -1, 0.0
        while not self.stopping.wait(FLOW_POLL_SECONDS):
            if self.flow is not None:
                self._abort_lost_chunks()
            # Each is_cancelled() is a round trip to the server process: ask once per engine step.
            if self.engine.num_steps == last_step or time.monotonic() - last_poll < CANCEL_POLL_SECONDS:
                continue
            last_step, last_poll = self.engine.num_steps, time.monotonic()
            for request_id in list(self.streams):
                with self.final_lock:
                    entry = self.streams.get(request_id)
                    # Triton never marks an ensemble's running llm step cancelled (server #6739).
                    cancelled = entry is not None and entry[0].flow is None and entry[1].is_cancelled()
                if cancelled:
                    self.engine.abort(request_id)

    def _abort_lost_chunks(self) -> None:
        evidence = self.flow.evidence(time.monotonic_ns())
        for request_id, (stream, _, _, _) in list(self.streams.items()):
            watch = stream.in_flight
            if watch is not None and watch.is_lost(self.flow, evidence):
                self.engine.abort(request_id)

    def _report_metrics(self, metrics) -> None:
        while not self.stopping.wait(METRICS_SECONDS):
            metrics.report(time.monotonic())

    def stop(self) -> None:
        self.stopping.set()
        # Triton has already waited for in-flight requests; whatever is left is cancelled.
        self.engine.stop(timeout=5.0)

    def _error(self, message: str):
        return self.pb.InferenceResponse(error=self.pb.TritonError(message))

    def _send_final(self, sender, response=None) -> None:
        sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
