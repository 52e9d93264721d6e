"""Triton adapter of the stateless detokenizer: tensors in, tritone.serving.Postprocessor, tensors out."""

import json

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import numpy as np
import triton_python_backend_utils as pb_utils

from tritone.serving import Postprocessor, ResponseState, exit_when_orphaned, model_parameters, triton_getter


class TritonPythonModel:
    def initialize(self, args):
        # Every model process watches for its server's death, not only the engine's: one
        # outlived a killed server in a full test run (serving.exit_when_orphaned).
        exit_when_orphaned()
        self.postprocess = Postprocessor.from_parameters(model_parameters(json.loads(args["model_config"])))

    def execute(self, requests):
        # Triton 2.51 marks every step of an ensemble request scheduled after its client
        # cancelled it, but never the llm step already running: tell the engine here.
        cancelled = [r.is_cancelled() for r in requests]
        for request, is_cancelled in zip(requests, cancelled):
            if is_cancelled:
                self._abort_in_engine(request)
        live = [r for r, is_cancelled in zip(requests, cancelled) if not is_cancelled]
        results = iter(self.postprocess([triton_getter(pb_utils, r) for r in live]))
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("request cancelled")) if is_cancelled
            else pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a[None]) for n, a in next(results).items()])
            for is_cancelled in cancelled
        ]

    def _abort_in_engine(self, request):
        key = ResponseState.read(pb_utils.get_input_tensor_by_name(request, "STATE").as_numpy()).request_key
        abort = pb_utils.InferenceRequest(model_name="llm", requested_output_names=[],
                                          inputs=[pb_utils.Tensor("ABORT_KEY", np.array([[key]], dtype=np.uint64))])
        for response in abort.exec(decoupled=True):  # one empty final response
            if response.has_error():
                pb_utils.Logger.log_error(f"abort of engine request {key} failed: {response.error().message()}")
