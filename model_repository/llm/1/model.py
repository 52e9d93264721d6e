"""Triton adapter of the engine: `execute` parses and enqueues, the engine's own threads do the
rest, and responses go out through each request's decoupled response sender
(tritone.serving.frontend.EngineFrontend)."""

import json
import logging
import os

# libgomp's threads (torch's ops; the native forward has threads of its own, csrc/pool.c) spin
# for 300,000 rounds before they sleep, keeping the cores busy through the Python between steps,
# which the tokenizer, detokenizer and server processes on the same cores need. 2,000 rounds
# cover the gaps between one forward pass's parallel regions, so steps run as fast, and sleep
# through the rest. Set before torch loads libgomp; a value set by the user stays.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.config import EngineConfig
from tritone.serving.flow import FlowBoard
from tritone.serving.frontend import EngineFrontend
from tritone.serving.inputs import (abort_target, flow_board_path, model_parameters, parse_llm_request,
                                    server_control_key, stream_interval, triton_getter)
from tritone.serving.lifecycle import Drain, exit_when_orphaned
from tritone.serving.metrics import EngineMetrics
from tritone.text import Detokenizer, load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        # The engine logs what it measured and chose at start (dtype, GEMM, compile time).
        logging.basicConfig(level=logging.INFO, format="[tritone] %(name)s: %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        # Shared with postprocessing's instances (tritone.serving.flow); forget a previous
        # server's marks.
        flow = FlowBoard(flow_board_path(params))
        flow.reset()
        self.control_key = server_control_key()
        if self.control_key is None:
            logging.getLogger("tritone").warning(
                "no control key in the environment (TRITONE_CONTROL_KEY; the launcher sets one): abort requests "
                "are refused, and any caller of this model may ask for flow control")
        # The detokenizer decodes for stop words and finds where each chunk's context starts.
        self.frontend = EngineFrontend(pb_utils, Detokenizer(load_tokenizer(params["model_dir"])),
                                       stream_interval(params), flow)
        self.frontend.launch(EngineConfig.from_parameters(params["model_dir"], params),
                             lambda engines: EngineMetrics(pb_utils, engines))
        exit_when_orphaned()
        # New requests are refused by preprocessing; this reports when the ones held are done.
        Drain(params.get("shutdown_file")).watch(lambda: self.frontend.is_idle, self.frontend.stopping)

    def execute(self, requests):
        for request in requests:
            sender, get = request.get_response_sender(), triton_getter(pb_utils, request)
            try:
                target = abort_target(get, self.control_key)
                if target is not None:
                    self.frontend.abort(target)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                parsed = parse_llm_request(get, self.control_key)
            except ValueError as exc:
                parsed = exc
            except Exception as exc:  # a malformed tensor: this request fails, not the batch
                parsed = ValueError(f"malformed request: {type(exc).__name__}: {exc}")
            # The Triton request id: an ensemble's steps carry the ensemble request's.
            self.frontend.submit(sender, parsed, request.request_id())
        return None

    def finalize(self):
        self.frontend.stop()
        self.frontend.flow.path.unlink(missing_ok=True)
