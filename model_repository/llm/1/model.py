"""Triton adapter of the engine: `execute` validates and enqueues, the engine's own threads do
the rest, and responses go out through each request's decoupled response sender."""

import itertools
import json
import logging
import os
import threading
import time

# libgomp's threads (torch's ops; the native forward has threads of its own, csrc/pool.c) spin
# for 300,000 rounds before they sleep, keeping both cores busy through the Python between
# steps, which the tokenizer, detokenizer and server processes on the same cores need. 2,000
# rounds cover the gaps between one forward pass's parallel regions (in process: the same step
# times at batch 1 and 8) and sleep through the rest (served tiny model at concurrency 256: 2,587
# -> 2,983 tok/s; the default model at 128: 351 -> 358). Set before torch loads libgomp; a value
# set by the user stays.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import numpy as np
import triton_python_backend_utils as pb_utils

from tritone.config import EngineConfig
from tritone.engine import AsyncEngine, LLMEngine
from tritone.flow import FlowBoard
from tritone.metrics import EngineMetrics
from tritone.request import FinishReason
from tritone.serving import (
    Drain, ResponseStream, abort_target, end_process, error_message, exit_when_orphaned, model_parameters,
    parse_llm_request, stream_interval, triton_getter)
from tritone.text import Detokenizer, load_tokenizer

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often client cancellations may be looked for: once a step, but no more than every 0.1 s,
# since each look at a direct caller's stream is an is_cancelled() round trip to the server (at
# 20 ms, the tiny model's steps at concurrency 256 asked thousands of times a second); the flow
# board, which tells of the ensemble's cancelled streams, is a read of shared memory, looked at
# every 0.05 s. And how often metrics are reported (often enough that the KV gauges trail the
# engine by a quarter second: the cancellation tests read them).
_CANCEL_POLL_SECONDS = 0.1
_FLOW_POLL_SECONDS = 0.05
_METRICS_SECONDS = 0.25


class TritonPythonModel:
    def initialize(self, args):
        # The engine logs what it measured and chose at start (dtype, GEMM, compile time).
        logging.basicConfig(level=logging.INFO, format="[tritone] %(name)s: %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        config = EngineConfig.from_parameters(params["model_dir"], params)
        self.stream_interval = stream_interval(params)
        self.streams = {}
        # Triton frees a request's response factory once its final response is sent, and asking
        # a freed one whether it was cancelled crashes the server: the two never overlap.
        self.final_lock = threading.Lock()
        self.ids = itertools.count()
        # Shared with postprocessing's instances; numbers every chunk sent (tritone.flow).
        self.flow, self.sends = FlowBoard(), itertools.count()
        self.flow.reset()
        # Decodes for stop words, and finds where each chunk's decoding context starts.
        self.detokenizer = Detokenizer(load_tokenizer(params["model_dir"]))
        self.engine = AsyncEngine.launch(lambda: LLMEngine(config), self._send, on_fatal=end_process)
        self.metrics = EngineMetrics(pb_utils, self.engine.engine)
        self.stopping = threading.Event()
        exit_when_orphaned()
        threading.Thread(target=self._watch_cancellations, daemon=True).start()
        threading.Thread(target=self._report_metrics, daemon=True).start()
        # New requests are refused by preprocessing; this reports when the ones held are done.
        Drain(params.get("shutdown_file")).watch(lambda: not self.streams, self.stopping)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            get = triton_getter(pb_utils, request)
            if (target := abort_target(get)) is not None:
                self._abort(*target)
                sender.send(flags=_FINAL)
                continue
            request_id = str(next(self.ids))
            try:
                parsed = parse_llm_request(get)
                # The Triton request id: an ensemble's steps carry the ensemble request's.
                stream = ResponseStream(parsed, self.detokenizer, self.stream_interval, key=int(request_id),
                                        flow=self.flow if parsed.flow_control else None, sends=self.sends)
                self.streams[request_id] = (stream, sender, request.request_id())
                self.engine.submit(request_id, parsed.prompt_ids, parsed.params)
            except (ValueError, RuntimeError) as exc:
                with self.final_lock:
                    self.streams.pop(request_id, None)
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=_FINAL)
        return None

    def _send(self, output):
        entry = self.streams.get(output.request_id)
        if entry is None:  # the engine's outputs after a stop word already ended the stream
            return
        stream, sender, _ = entry
        message = error_message(output)
        if message is not None:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        else:
            tensors = stream.on_output(output)
            if tensors is None:
                return
            response = pb_utils.InferenceResponse([pb_utils.Tensor(n, a[None]) for n, a in tensors.items()])
            if stream.is_finished and not output.finished:
                self.engine.abort(output.request_id, FinishReason.STOP)
        if not (output.finished or stream.is_finished):
            sender.send(response)
            return
        with self.final_lock:
            if message is not None:  # the last try: the engine's sender sends nothing after it
                del self.streams[output.request_id]
            sender.send(response, flags=_FINAL)  # if it raises, the sender sends an error
            self.streams.pop(output.request_id, None)

    def _abort(self, key, triton_id):
        # Unknown or finished requests are ignored: aborts may race with the end of a request.
        ids = [str(key)] if key is not None else [i for i, e in list(self.streams.items()) if e[2] == triton_id]
        for request_id in ids:
            self.engine.abort(request_id)

    def _watch_cancellations(self):
        # The engine answers an abort with a final "cancelled" output, which closes the stream;
        # until then the response factory stays alive and unload waits.
        last_step, last_poll = -1, 0.0
        while not self.stopping.wait(_FLOW_POLL_SECONDS):
            evidence = self.flow.evidence(time.monotonic_ns())
            for request_id, (stream, _, _) in list(self.streams.items()):
                watch = stream.in_flight
                if watch is not None and watch.is_lost(self.flow, evidence):
                    self.engine.abort(request_id)
            # Each is_cancelled() is a round trip to the server process: ask once per engine step.
            if self.engine.num_steps == last_step or time.monotonic() - last_poll < _CANCEL_POLL_SECONDS:
                continue
            last_step, last_poll = self.engine.num_steps, time.monotonic()
            for request_id in list(self.streams):
                with self.final_lock:
                    entry = self.streams.get(request_id)
                    # Triton never marks an ensemble's running llm step cancelled (server #6739).
                    cancelled = entry is not None and entry[0].flow is None and entry[1].is_cancelled()
                if cancelled:
                    self.engine.abort(request_id)

    def _report_metrics(self):
        while not self.stopping.wait(_METRICS_SECONDS):
            self.metrics.report(time.monotonic())

    def finalize(self):
        self.stopping.set()
        self.flow.path.unlink(missing_ok=True)
        # Triton has already waited for in-flight requests; whatever is left is cancelled.
        self.engine.stop(timeout=5.0)
