"""Triton adapter of the tokenizer: tensors in, tritone.serving.processing.Preprocessor, tensors out."""

import json

try:  # the launcher puts this beside the Python backend: it adds the environment's paths
    import tritone_env  # noqa: F401
except ImportError:  # NVIDIA's container, where the package is installed system-wide
    pass

import numpy as np
import triton_python_backend_utils as pb_utils

from tritone.serving.inputs import model_parameters, server_control_key, triton_getter
from tritone.serving.lifecycle import SHUTTING_DOWN, Drain, exit_when_orphaned
from tritone.serving.processing import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        # Every model process watches for its server's death, not only the engine's: one
        # outlived a killed server in a full test run (tritone.serving.lifecycle).
        exit_when_orphaned()
        params = model_parameters(json.loads(args["model_config"]))
        self.preprocess = Preprocessor(params)
        # The ensemble's entry: during a drain, new requests stop here.
        self.drain = Drain(params.get("shutdown_file"))
        # Tells the llm model the request comes through the ensemble (tritone.serving.inputs).
        self.control_key = np.array([[server_control_key() or b""]], dtype=np.object_)

    def execute(self, requests):
        if self.drain.requested():
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(SHUTTING_DOWN)) for _ in requests]
        getters = [triton_getter(pb_utils, r) for r in requests]
        responses = []
        for result in self.preprocess(getters):
            if isinstance(result, Exception):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(result))))
            else:
                tensors = [pb_utils.Tensor(name, array[None]) for name, array in result.items()]
                tensors.append(pb_utils.Tensor("CONTROL_KEY", self.control_key))
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

