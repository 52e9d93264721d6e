"""The `llm` model adapter's sending, with a fake of Triton's Python-backend utilities."""

import importlib.util
import pathlib
import sys
import threading
import types

import pytest

from tritone.request import FinishReason, RequestOutput, SamplingParams
from tritone.serving import LLMRequest, ResponseStream

FINAL = 1
MODEL_PY = pathlib.Path(__file__).parent.parent / "model_repository" / "llm" / "1" / "model.py"


class FakeSender:
    def __init__(self, fail_final_sends=0):
        self.sent = []
        self.fail_final_sends = fail_final_sends

    def send(self, response, flags=0):
        if flags == FINAL and self.fail_final_sends:
            self.fail_final_sends -= 1
            raise RuntimeError("injected send fault")
        self.sent.append((response, flags))


@pytest.fixture
def model(monkeypatch):
    pb_utils = types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        InferenceResponse=lambda tensors=None, error=None: types.SimpleNamespace(tensors=tensors, error=error),
        TritonError=lambda message: message,
        Tensor=lambda name, array: (name, array),
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    spec = importlib.util.spec_from_file_location("llm_model_under_test", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.streams, model.final_lock = {}, threading.Lock()
    model.engine = types.SimpleNamespace(abort=lambda *args: None)
    return model


def test_a_final_response_that_fails_to_send_is_followed_by_one_error_response(model, detokenizer):
    sender = FakeSender(fail_final_sends=1)
    request = LLMRequest([1, 2], SamplingParams(max_tokens=1), stream=False, exclude_input_in_output=True,
                         skip_special_tokens=True)
    model.streams["7"] = (ResponseStream(request, detokenizer), sender, "triton-7")
    with pytest.raises(RuntimeError):
        model._send(RequestOutput("7", [42], [0.0], 2, 1, True, FinishReason.LENGTH))
    assert "7" in model.streams  # kept, so that the engine's sender can still end it
    model._send(RequestOutput("7", [], [], 2, 1, True, FinishReason.ERROR, error="sending a response failed"))
    ((response, flags),) = sender.sent
    assert flags == FINAL and "sending a response failed" in response.error
    assert not model.streams


@pytest.fixture(scope="module")
def detokenizer(tokenizer):
    from tritone.text import Detokenizer

    return Detokenizer(tokenizer)
