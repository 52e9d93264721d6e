"""Triton adapter of the single-process ablation: the `llm` model's adapter with the text work
of preprocessing and postprocessing (tritone.inline) done in this process."""

import itertools
import json
import logging
import os
import threading
import time

os.environ.setdefault("GOMP_SPINCOUNT", "2000")  # as in `llm`: before torch loads libgomp

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.config import EngineConfig
from tritone.engine import AsyncEngine, LLMEngine
from tritone.inline import InlineText
from tritone.metrics import EngineMetrics
from tritone.request import FinishReason
from tritone.serving import (
    SHUTTING_DOWN, Drain, ResponseStream, end_process, error_message, exit_when_orphaned, model_parameters,
    stream_interval, triton_getter)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_CANCEL_POLL_SECONDS = 0.1
_METRICS_SECONDS = 1.0


class TritonPythonModel:
    def initialize(self, args):
        # The engine logs what it measured and chose at start (dtype, GEMM, compile time).
        logging.basicConfig(level=logging.INFO, format="[tritone] %(name)s: %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        self.text = InlineText(params)
        self.stream_interval = stream_interval(params)
        self.streams = {}
        # As in `llm`: a final response and an is_cancelled() call on its factory never overlap.
        self.final_lock = threading.Lock()
        self.ids = itertools.count()
        config = EngineConfig.from_parameters(params["model_dir"], params)
        self.engine = AsyncEngine.launch(lambda: LLMEngine(config), self._send, on_fatal=end_process)
        self.metrics = EngineMetrics(pb_utils, self.engine.engine, "llm_inline")
        self.stopping = threading.Event()
        exit_when_orphaned()
        threading.Thread(target=self._watch_cancellations, daemon=True).start()
        threading.Thread(target=self._report_metrics, daemon=True).start()
        self.drain = Drain(params.get("shutdown_file"))
        self.drain.watch(lambda: not self.streams, self.stopping)

    def execute(self, requests):
        if self.drain.requested():
            for request in requests:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(SHUTTING_DOWN)), flags=_FINAL)
            return None
        parsed = self.text.parse([triton_getter(pb_utils, r) for r in requests])
        for request, llm_request in zip(requests, parsed):
            sender = request.get_response_sender()
            request_id = str(next(self.ids))
            try:
                if isinstance(llm_request, Exception):
                    raise llm_request
                stream = ResponseStream(llm_request, self.text.detokenizer, self.stream_interval)
                self.streams[request_id] = (stream, sender)
                self.engine.submit(request_id, llm_request.prompt_ids, llm_request.params)
            except (ValueError, RuntimeError) as exc:
                with self.final_lock:
                    self.streams.pop(request_id, None)
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=_FINAL)
        return None

    def _send(self, output):
        entry = self.streams.get(output.request_id)
        if entry is None:
            return
        stream, sender = entry
        message = error_message(output)
        if message is not None:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        else:
            tensors = stream.on_output(output)
            if tensors is None:
                return
            outputs = self.text.outputs(tensors)
            response = pb_utils.InferenceResponse([pb_utils.Tensor(n, a[None]) for n, a in outputs.items()])
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

    def _watch_cancellations(self):
        last_step = -1
        while not self.stopping.wait(_CANCEL_POLL_SECONDS):
            if self.engine.num_steps == last_step:
                continue
            last_step = self.engine.num_steps
            for request_id in list(self.streams):
                with self.final_lock:
                    entry = self.streams.get(request_id)
                    cancelled = entry is not None and entry[1].is_cancelled()
                if cancelled:
                    self.engine.abort(request_id)

    def _report_metrics(self):
        while not self.stopping.wait(_METRICS_SECONDS):
            self.metrics.report(time.monotonic())

    def finalize(self):
        self.stopping.set()
        self.engine.stop(timeout=5.0)
