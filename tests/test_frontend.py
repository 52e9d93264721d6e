"""The engine's side of the llm and llm_inline models (tritone.serving.frontend), with a fake of Triton's
Python-backend utilities and a fake engine."""

import threading
import time
import types

import pytest

from tritone.scheduling.request import FinishReason, RequestOutput, SamplingParams
from tritone.serving.flow import FlowBoard
from tritone.serving.frontend import EngineFrontend
from tritone.serving.inputs import LLMRequest
from tritone.serving.responses import ResponseState
from tritone.text import Detokenizer

FINAL = 1
PB_UTILS = types.SimpleNamespace(
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
    InferenceResponse=lambda tensors=None, error=None: types.SimpleNamespace(tensors=tensors, error=error),
    TritonError=lambda message: message,
    Tensor=lambda name, array: (name, array),
)


class FakeSender:
    def __init__(self, fail_final_sends=0, cancelled=False):
        self.sent, self.fail_final_sends, self.cancelled = [], fail_final_sends, cancelled

    def send(self, response=None, flags=0):
        if flags == FINAL and self.fail_final_sends:
            self.fail_final_sends -= 1
            raise RuntimeError("injected send fault")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class FakeEngine:
    def __init__(self, refuse=None):
        self.submitted, self.aborted, self.num_steps, self.refuse = [], [], 0, refuse

    def submit(self, request_id, prompt_ids, params):
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.submitted.append(request_id)

    def abort(self, request_id, reason=FinishReason.CANCELLED, error=None):
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def detokenizer(tokenizer):
    return Detokenizer(tokenizer)


def frontend_of(detokenizer, engine=None, flow=None):
    frontend = EngineFrontend(PB_UTILS, detokenizer, flow=flow)
    frontend.engine = engine or FakeEngine()
    return frontend


def request(stream=False, flow_control=False, max_tokens=1):
    return LLMRequest([1, 2], SamplingParams(max_tokens=max_tokens), stream=stream, exclude_input_in_output=True,
                      skip_special_tokens=True, flow_control=flow_control)


def test_a_final_response_that_fails_to_send_is_followed_by_one_error_response(detokenizer):
    frontend, sender = frontend_of(detokenizer), FakeSender(fail_final_sends=1)
    frontend.submit(sender, request())
    (request_id,) = frontend.streams
    with pytest.raises(RuntimeError):
        frontend.send(RequestOutput(request_id, [42], [0.0], 2, 1, True, FinishReason.LENGTH))
    assert request_id in frontend.streams  # kept, so that the engine's sender can still end it
    frontend.send(RequestOutput(request_id, [], [], 2, 1, True, FinishReason.ERROR, error="sending a response failed"))
    ((response, flags),) = sender.sent
    assert flags == FINAL and "sending a response failed" in response.error
    assert frontend.is_idle


def test_a_stream_of_the_ensemble_fails_in_band_after_its_chunks_and_a_direct_one_with_an_error(detokenizer,
                                                                                                  tmp_path):
    # Triton 2.51's ensemble never releases a request whose llm step fails while postprocessing
    # holds one of its chunks: the ensemble's streams send their error through postprocessing.
    frontend = frontend_of(detokenizer, flow=FlowBoard(tmp_path / "flow"))
    ensemble, direct = FakeSender(), FakeSender()
    frontend.submit(ensemble, request(stream=True, flow_control=True, max_tokens=8))
    frontend.submit(direct, request(stream=True, max_tokens=8))
    for request_id in ("0", "1"):
        frontend.send(RequestOutput(request_id, [42], [0.0], 2, 1, False, None))
        frontend.send(RequestOutput(request_id, [], [], 2, 1, True, FinishReason.ERROR,
                                    error="model worker 0 of engine 0 failed"))
    (chunk, flags), (failed, final) = ensemble.sent
    tensors = dict(failed.tensors)
    assert flags == 0 and dict(chunk.tensors)["TOKEN_IDS"].tolist() == [[42]]
    assert final == FINAL and failed.error is None and tensors["TOKEN_IDS"].size == 0
    assert tensors["ERROR"].tolist() == [[b"model worker 0 of engine 0 failed"]]
    assert ResponseState.read(tensors["STATE"]).finish_reason == "error"
    assert ResponseState.read(tensors["STATE"]).is_final
    (_, _), (response, final) = direct.sent
    assert final == FINAL and response.error == "model worker 0 of engine 0 failed"
    assert frontend.is_idle


def test_a_bad_or_refused_request_gets_one_final_error_naming_why(detokenizer):
    frontend, sender = frontend_of(detokenizer), FakeSender()
    frontend.submit(sender, ValueError("max_tokens is missing"))
    frontend.engine.refuse = "server busy: the request queue is full, retry later"
    frontend.submit(sender, request())
    assert [(r.error, f) for r, f in sender.sent] == [("max_tokens is missing", FINAL),
                                                      ("server busy: the request queue is full, retry later", FINAL)]
    assert frontend.is_idle


def test_aborts_by_triton_request_id_and_an_early_one_meets_its_request(detokenizer):
    frontend = frontend_of(detokenizer)
    for triton_id in ("a", "b", "a"):
        frontend.submit(FakeSender(), request(), triton_id)
    frontend.abort("a")
    assert frontend.engine.aborted == ["0", "2"]
    frontend.abort("c")  # its client left while preprocessing tokenized its prompt
    frontend.submit(FakeSender(), request(), "c")
    frontend.submit(FakeSender(), request(), "c")  # remembered once, not for good
    assert frontend.engine.aborted == ["0", "2", "3"]


def test_flow_slots_are_given_back_and_keys_are_not_guessable(detokenizer, tmp_path):
    flow = FlowBoard(tmp_path / "flow")
    frontend = frontend_of(detokenizer, flow=flow)
    free = len(frontend.free_slots)
    senders = [FakeSender() for _ in range(3)]
    for sender in senders:
        frontend.submit(sender, request(stream=True, flow_control=True, max_tokens=1))
    keys = [frontend.streams[str(i)][0].key for i in range(3)]
    assert len(frontend.free_slots) == free - 3 and len({k >> 16 for k in keys}) == 3
    for i in range(3):
        frontend.send(RequestOutput(str(i), [42], [0.0], 2, 1, True, FinishReason.LENGTH))
    assert frontend.is_idle and len(frontend.free_slots) == free
    assert all(not flow.is_received(k, 0) for k in keys)  # released: no mark counts for them


def test_a_direct_stream_is_polled_for_cancellation_and_an_ensemble_stream_is_not(detokenizer, tmp_path):
    flow = FlowBoard(tmp_path / "flow")
    frontend = frontend_of(detokenizer, flow=flow)
    frontend.submit(FakeSender(cancelled=True), request(stream=True))  # a direct caller of llm
    frontend.submit(FakeSender(cancelled=True), request(stream=True, flow_control=True))  # never asked
    threading.Thread(target=frontend.watch_cancellations, daemon=True).start()
    deadline = time.monotonic() + 5
    while not frontend.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    frontend.stopping.set()
    assert frontend.engine.aborted == ["0"]


def test_an_ensemble_stream_whose_chunk_is_lost_is_aborted(detokenizer, tmp_path):
    flow, post = FlowBoard(tmp_path / "flow"), FlowBoard(tmp_path / "flow")
    flow.reset()
    post.claim_cell()
    frontend = frontend_of(detokenizer, flow=flow)
    sender = FakeSender()
    frontend.submit(sender, request(stream=True, flow_control=True, max_tokens=8))
    frontend.send(RequestOutput("0", [42], [0.0], 2, 1, False, None))
    assert len(sender.sent) == 1  # the first chunk went; the batcher drops it, unseen
    post.received([])
    post.done()  # postprocessing idles: nothing waits for it
    threading.Thread(target=frontend.watch_cancellations, daemon=True).start()
    deadline = time.monotonic() + 5
    while not frontend.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    frontend.stopping.set()
    assert frontend.engine.aborted == ["0"]
