"""logit_bias: OpenAI's field, the ensemble's JSON input, the engine's parameter and the sampler's
bias, each refusing what OpenAI refuses with a message that names the field."""

import numpy as np
import pytest
import torch

from test_openai_guard import chat, post, served
from tritone.executor.sampler import Sampler, needs_logits
from tritone.executor.sampling_state import SamplingState
from tritone.scheduling.request import SamplingParams
from tritone.serving.inputs import parse_llm_request

VOCAB = 64


def state(seed=0, **params):
    return SamplingState(SamplingParams(max_tokens=100, **params), [5, 9], torch.Generator().manual_seed(seed),
                         frozenset({2}))


def logits(rows=1, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_large_bias_makes_its_token_the_greedy_choice_and_a_small_one_bans_it():
    x = logits(4, seed=1)
    greedy = x.argmax(dim=-1).tolist()
    rows = [state(logit_bias={7: 100.0}), state(), state(logit_bias={greedy[2]: -100.0}),
            state(logit_bias={greedy[3]: 0.5, 11: -1.0})]
    assert needs_logits(rows) and needs_logits(rows[:1]) and not needs_logits(rows[1:2])
    tokens, _ = Sampler()(x.clone(), rows)
    assert tokens[0] == 7 and tokens[1] == greedy[1] and tokens[2] != greedy[2] and tokens[3] == greedy[3]
    biased = x[2].clone()
    biased[greedy[2]] -= 100.0
    assert tokens[2] == int(biased.argmax())


def test_sampled_rows_draw_from_the_biased_distribution():
    rows = [state(seed=s, temperature=1.0, logit_bias={3: 100.0, 4: 100.0}) for s in range(32)]
    tokens, _ = Sampler()(logits(32, seed=2), rows)
    assert set(tokens) <= {3, 4}
    rows = [state(seed=s, temperature=1.0, logit_bias={t: -100.0 for t in range(VOCAB - 1)}) for s in range(8)]
    assert Sampler()(logits(8, seed=3), rows)[0] == [VOCAB - 1] * 8


@pytest.mark.parametrize("bias, message", [
    ({VOCAB: 1.0}, "outside the vocabulary"), ({-1: 1.0}, "outside the vocabulary"),
    ({1: 100.5}, "must be in [-100, 100]"), ({1: float("nan")}, "must be in [-100, 100]"),
    ({i: 1.0 for i in range(301)}, "over the limit of 300")])
def test_the_engine_refuses_what_openai_refuses(bias, message):
    with pytest.raises(ValueError, match=r"^logit_bias") as caught:
        SamplingParams(logit_bias=bias).validate(VOCAB)
    assert message in str(caught.value)
    SamplingParams(logit_bias={0: -100, VOCAB - 1: 100}).validate(VOCAB)


def getter(**inputs):
    arrays = {k.upper(): np.asarray(v) for k, v in inputs.items()}
    return lambda name: arrays.get(name)


def test_the_llm_model_reads_a_json_object_of_token_ids():
    req = parse_llm_request(getter(input_ids=[1], max_tokens=[5], logit_bias=np.array([b'{"7": 100, "12": -5.5}'],
                                                                                        dtype=object)))
    assert req.params.logit_bias == {7: 100.0, 12: -5.5}
    assert parse_llm_request(getter(input_ids=[1], max_tokens=[5])).params.logit_bias == {}


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{", b'{"a": 1}', b'{"-3": 1}', b'{"3": "high"}', b'{"3": true}',
                                 "{\"\u00b2\": 1}".encode()])
def test_a_malformed_input_names_the_field(raw):
    with pytest.raises(ValueError, match=r"^logit_bias"):
        parse_llm_request(getter(input_ids=[1], max_tokens=[5], logit_bias=np.array([raw], dtype=object)))


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 5}, {"5": 100.5}, {"5": -101}, {str(i): 1 for i in range(301)},
                                  {"5": "many"}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_front_end_refuses_it_with_a_400_before_the_backend(bias, path):
    app, backend = served()
    body = chat(logit_bias=bias) if "chat" in path else {"model": "tiny", "prompt": "Hi", "logit_bias": bias}
    response = post(app, path, body)
    assert response.status == 400 and "logit_bias" in response.error["message"], response.body
    assert response.error["param"].startswith("logit_bias") and backend.calls == []


def test_the_front_end_sends_it_to_the_ensemble_as_json():
    app, backend = served()
    post(app, "/v1/completions", {"model": "tiny", "prompt": "Hi", "logit_bias": {"7": 100, "9": -2}})
    (tensors,) = backend.calls
    assert tensors["logit_bias"].tolist() == [[b'{"7": 100.0, "9": -2.0}']]
