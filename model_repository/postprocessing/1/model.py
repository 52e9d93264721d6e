"""Triton adapter of the stateless detokenizer: tensors in, tritone.serving.processing.Postprocessor,
tensors out."""

import json

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.serving.flow import FlowBoard
from tritone.serving.inputs import flow_board_path, model_parameters
from tritone.serving.lifecycle import exit_when_orphaned
from tritone.serving.processing import Postprocessor


class TritonPythonModel:
    def initialize(self, args):
        # Every model process watches for its server's death, not only the engine's: one
        # outlived a killed server in a full test run (tritone.serving.lifecycle).
        exit_when_orphaned()
        # What this instance receives and when it idles, for the llm model (tritone.serving.flow):
        # its flow control, and how it learns of cancelled requests, whose chunks the batcher drops.
        params = model_parameters(json.loads(args["model_config"]))
        flow = FlowBoard(flow_board_path(params))
        flow.claim_cell()
        self.postprocess = Postprocessor.from_parameters(params, flow)

    def execute(self, requests):
        # Each input once, without the batch dimension (pb_utils.get_input_tensor_by_name looks
        # through the inputs in Python for every name).
        inputs = [{t.name(): t.as_numpy()[0] for t in r.inputs()} for r in requests]
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(str(result))) if isinstance(result, Exception)
                else pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a[None]) for n, a in result.items()])
                for result in self.postprocess([i.get for i in inputs])]
