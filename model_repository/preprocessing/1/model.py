"""Triton adapter of the tokenizer: tensors in, tritone.serving.Preprocessor, tensors out."""

import json

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import triton_python_backend_utils as pb_utils

from tritone.serving import Preprocessor, model_parameters, triton_getter


class TritonPythonModel:
    def initialize(self, args):
        self.preprocess = Preprocessor(model_parameters(json.loads(args["model_config"])))

    def execute(self, requests):
        getters = [triton_getter(pb_utils, r) for r in requests]
        responses = []
        for result in self.preprocess(getters):
            if isinstance(result, Exception):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(result))))
            else:
                tensors = [pb_utils.Tensor(name, array[None]) for name, array in result.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

