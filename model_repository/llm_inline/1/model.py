"""Triton adapter of the one-process pipeline (served as "ensemble" where the engine runs on the
CPU): the `llm` model's frontend with the text work of preprocessing and postprocessing
(tritone.serving.inline) done in this process."""

import json
import logging
import os

os.environ.setdefault("GOMP_SPINCOUNT", "2000")  # as in `llm`: before torch loads libgomp

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.config import EngineConfig
from tritone.serving.frontend import EngineFrontend
from tritone.serving.inline import InlineText
from tritone.serving.inputs import model_parameters, stream_interval, triton_getter
from tritone.serving.lifecycle import SHUTTING_DOWN, Drain, exit_when_orphaned
from tritone.serving.metrics import EngineMetrics


class TritonPythonModel:
    def initialize(self, args):
        # The engine logs what it measured and chose at start (dtype, GEMM, compile time).
        logging.basicConfig(level=logging.INFO, format="[tritone] %(name)s: %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        self.text = InlineText(params)
        # No postprocessing to mark chunks: no flow board; responses detokenized here.
        self.frontend = EngineFrontend(pb_utils, self.text.detokenizer, stream_interval(params),
                                       outputs=self.text.outputs)
        self.frontend.launch(EngineConfig.from_parameters(params["model_dir"], params),
                             lambda engines: EngineMetrics(pb_utils, engines, "llm_inline"))
        exit_when_orphaned()
        self.drain = Drain(params.get("shutdown_file"))
        self.drain.watch(lambda: self.frontend.is_idle, self.frontend.stopping)

    def execute(self, requests):
        if self.drain.requested():
            for request in requests:
                request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(SHUTTING_DOWN)),
                                                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        for request, parsed in zip(requests, self.text.parse([triton_getter(pb_utils, r) for r in requests])):
            self.frontend.submit(request.get_response_sender(), parsed, request.request_id())
        return None

    def finalize(self):
        self.frontend.stop()
