"""Triton adapter of the stateless detokenizer: tensors in, tritone.serving.Postprocessor, tensors out."""

import json

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.serving import Postprocessor, model_parameters, triton_getter


class TritonPythonModel:
    def initialize(self, args):
        self.postprocess = Postprocessor.from_parameters(model_parameters(json.loads(args["model_config"])))

    def execute(self, requests):
        results = self.postprocess([triton_getter(pb_utils, r) for r in requests])
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a[None]) for n, a in result.items()])
            for result in results
        ]

