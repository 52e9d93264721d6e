"""The sampler's transforms against Hugging Face's logits processors on the same logits.

Each row of a batch has its own parameters and its own tokens; Hugging Face's processors run on
that row alone, with the prompt and the output as `input_ids`, as in `generate`.
"""

import contextlib
import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from tritone.executor.sampler import Sampler, _mask_top_k_top_p_sorted, apply_bans, apply_penalties, needs_logits, warp
from tritone.executor import kernels
from tritone.executor.sampling_state import SamplingState
from tritone.scheduling.request import SamplingParams

VOCAB = 64
END_IDS = frozenset({2, 3})


def request(prompt, output=(), seed=0, **params):
    return SamplingState(SamplingParams(max_tokens=100, **params), list(prompt), torch.Generator().manual_seed(seed),
                         END_IDS, output_ids=list(output))


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def input_ids(req):
    return torch.tensor([req.prompt_ids + req.output_ids])


def hf_warpers(p: SamplingParams) -> LogitsProcessorList:
    """The warpers `generate` builds for these parameters, in its order."""
    warpers = LogitsProcessorList()
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    return warpers


def assert_same_logits(ours, reference):
    assert torch.equal(torch.isinf(ours), torch.isinf(reference)), "different tokens removed"
    finite = torch.isfinite(reference)
    torch.testing.assert_close(ours[finite], reference[finite])


PROMPT = [5, 9, 9, 14, 20, 33]
OUTPUT = [9, 41, 41, 41, 7, 60]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_covers_prompt_and_output_like_hugging_face(penalty):
    reqs = [request(PROMPT, OUTPUT, repetition_penalty=penalty), request(PROMPT, [], repetition_penalty=penalty),
            request(PROMPT, OUTPUT)]
    logits = random_logits(3)
    ours = logits.clone()
    apply_penalties(ours, reqs)
    for i, req in enumerate(reqs):
        reference = RepetitionPenaltyLogitsProcessor(req.params.repetition_penalty)(input_ids(req), logits[i:i + 1].clone())
        assert_same_logits(ours[i:i + 1], reference)


def test_presence_and_frequency_penalties_count_output_tokens_only_after_the_repetition_penalty():
    # Hugging Face has no presence or frequency penalty: the reference is vLLM's (and OpenAI's)
    # definition, logit - frequency * count - presence * (count > 0), over output tokens.
    req = request(PROMPT, OUTPUT, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25)
    logits = random_logits(1)
    ours = logits.clone()
    apply_penalties(ours, [req])
    reference = RepetitionPenaltyLogitsProcessor(1.2)(input_ids(req), logits.clone())
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).float()
    reference -= 0.25 * counts + 0.5 * (counts > 0).float()
    assert_same_logits(ours, reference)
    assert ours[0, 5] == reference[0, 5]  # a prompt token: repetition penalty only


WARPS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    # top-p measured over the top-k set, renormalised, as Hugging Face does
    dict(temperature=1.0, top_k=10, top_p=0.5),
    dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=0.5, top_p=0.3, min_p=0.2),
]


def test_temperature_top_k_top_p_min_p_and_their_combinations_match_hugging_face():
    reqs = [request(PROMPT, OUTPUT, **w) for w in WARPS]
    logits = random_logits(len(WARPS), seed=1)
    ours = warp(logits.clone(), reqs)
    for i, req in enumerate(reqs):
        reference = hf_warpers(req.params)(input_ids(req), logits[i:i + 1].clone())
        assert_same_logits(ours[i:i + 1], reference)


def test_sampled_tokens_follow_hugging_faces_distribution():
    # 4000 rows of the same logits, each with its own random stream: the frequencies of the
    # sampled tokens approach the probabilities after Hugging Face's warpers.
    params = dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)
    reqs = [request(PROMPT, [], seed=s, **params) for s in range(4000)]
    logits = random_logits(1, seed=2)
    tokens, _ = Sampler()(logits.expand(len(reqs), -1).clone(), reqs)
    probs = torch.softmax(hf_warpers(reqs[0].params)(input_ids(reqs[0]), logits.clone()), dim=-1)[0]
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)
    assert set(tokens) <= set(probs.nonzero().flatten().tolist())
    assert (freq - probs).abs().max() < 0.03


def test_bad_words_are_banned_like_hugging_face_also_across_the_prompts_end():
    bad = [[50], [41, 12], [7, 60, 13], [33, 9, 8], [20, 44]]
    # [33, 9] ends the prompt and starts the output: its last token is banned next if the output
    # is [9]; with OUTPUT, [7, 60] ends it.
    reqs = [request(PROMPT, OUTPUT, bad_token_ids=bad), request(PROMPT[:5], [33], bad_token_ids=bad),
            request([1, 33], [9], bad_token_ids=bad)]
    logits = random_logits(3, seed=3)
    ours = logits.clone()
    apply_bans(ours, reqs)
    for i, req in enumerate(reqs):
        reference = NoBadWordsLogitsProcessor(bad)(input_ids(req), logits[i:i + 1].clone())
        assert_same_logits(ours[i:i + 1], reference)
    assert torch.isinf(ours[2, 8]) and torch.isinf(ours[0, 13])


@pytest.mark.parametrize("num_output", [0, 2, 3, 4])
def test_min_tokens_bans_every_end_id_like_hugging_face(num_output):
    req = request(PROMPT, OUTPUT[:num_output], min_tokens=3)
    logits = random_logits(1, seed=4)
    logits[0, 2] = logits[0, 3] = 50.0  # an end id would win
    ours = logits.clone()
    apply_bans(ours, [req])
    processor = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, sorted(END_IDS))
    assert_same_logits(ours, processor(input_ids(req), logits.clone()))


def test_log_probs_are_those_of_the_penalized_and_banned_distribution():
    bad = [[41, 12]]
    reqs = [request(PROMPT, OUTPUT, repetition_penalty=1.5, bad_token_ids=bad, return_log_probs=True,
                    min_tokens=10),
            request(PROMPT, OUTPUT, return_log_probs=True)]
    logits = random_logits(2, seed=5)
    tokens, log_probs = Sampler()(logits.clone(), reqs)
    for i, req in enumerate(reqs):
        processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(req.params.repetition_penalty),
                                          NoBadWordsLogitsProcessor(bad),
                                          MinNewTokensLengthLogitsProcessor(len(PROMPT), req.params.min_tokens,
                                                                            sorted(END_IDS))])
        reference = processors(input_ids(req), logits[i:i + 1].clone())
        assert tokens[i] == int(reference.argmax())
        assert math.isclose(log_probs[i], float(torch.log_softmax(reference, -1)[0, tokens[i]]), rel_tol=1e-5)


def test_a_tiny_temperature_is_greedy_instead_of_nan():
    logits = random_logits(2, seed=6)
    reqs = [request(PROMPT, seed=s, temperature=1e-30) for s in range(2)]
    assert all(r.params.is_greedy for r in reqs)
    tokens, _ = Sampler()(logits.clone(), reqs)
    assert tokens == logits.argmax(-1).tolist()
    assert not request(PROMPT, temperature=1e-4).params.is_greedy


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_parameters_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(VOCAB)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_additive_penalties_stay_within_openais_range(field):
    SamplingParams(**{field: -2.0}).validate(VOCAB)
    SamplingParams(**{field: 2.0}).validate(VOCAB)
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: 2.5}).validate(VOCAB)


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 100, 49152 + 5])
def test_native_argmax_is_torchs(n):
    # Few distinct values, so that ties are everywhere: the lowest index of the maximum wins,
    # as in torch's argmax and so in Hugging Face's greedy choice; rows of -inf as after bans.
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 3, (6, n), generator=gen).float()
    x[1] = float("-inf")
    x[2, -1] = 10.0  # the maximum in the tail past the last whole group of eight
    x[3, 0] = 10.0
    assert kernels.native_library() is not None
    assert kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert kernels.argmax_rows(x[:, : max(1, n // 2)]).tolist() == x[:, : max(1, n // 2)].argmax(dim=-1).tolist()


@pytest.mark.parametrize("params,needed", [
    ({}, False), ({"top_k": 1, "temperature": 0.7}, False), ({"min_tokens": 3}, False),  # 6 outputs: reached
    ({"temperature": 0.7}, True), ({"return_log_probs": True}, True), ({"repetition_penalty": 1.3}, True),
    ({"presence_penalty": 0.5}, True), ({"frequency_penalty": 0.5}, True), ({"bad_token_ids": [[50]]}, True),
    ({"min_tokens": 10}, True)])
def test_only_plain_greedy_steps_skip_the_logits(params, needed):
    # Where needs_logits says no, the engine takes the raw logits' argmax without sampling them
    # (the native forward never writes them): it must be exactly what the sampler would choose.
    req = request(PROMPT, OUTPUT, **params)
    assert needs_logits([req]) is needed and needs_logits([request(PROMPT, OUTPUT), req]) is needed
    logits = random_logits(1, seed=5)
    logits[0, 2] = 50.0  # an end id wins unless banned
    tokens, _ = Sampler()(logits.clone(), [req])
    assert (tokens == logits.argmax(dim=-1).tolist()) or needed


@pytest.mark.parametrize("params", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_p=0.5),
                                    dict(temperature=0.8, top_k=300, top_p=0.95), dict(temperature=0.9, min_p=0.05),
                                    dict(temperature=0.6, top_p=0.8, min_p=0.1)])
def test_warping_a_large_vocabulary_matches_hugging_face(params):
    # 5,000 tokens, peaked rows and a flat one (scaled down), whose top-p set is most of the
    # vocabulary: top-p alone goes to the native bucketing kernel, with top-k to torch.topk.
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.randn(2, 5000, generator=gen) * 4, torch.randn(1, 5000, generator=gen) * 0.05])
    reqs = [request(PROMPT, OUTPUT, **params) for _ in range(len(logits))]
    ours = warp(logits.clone(), reqs)
    for i, req in enumerate(reqs):
        assert_same_logits(ours[i:i + 1], hf_warpers(req.params)(input_ids(req), logits[i:i + 1].clone()))


def test_the_sampling_kernel_inverts_the_cumulative_distribution(monkeypatch):
    # The same uniforms through the native kernel and through torch's softmax, cumsum and
    # searchsorted (also the kernel's own fallback) pick the same tokens; removed tokens are never
    # drawn, even at u = 0.
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 3001, generator=gen) * 3
    x[:, :10] = float("-inf")
    x[:, 2000:2500] = float("-inf")
    inv_t = torch.rand(64, generator=gen) + 0.5
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 1e-12
    got = kernels.sample_rows(x, inv_t, u)
    probs = torch.softmax(x.double() * inv_t.double()[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    want = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).flatten()
    assert (got == want).float().mean() > 0.95  # rounding may move a draw that sits on a boundary
    assert all(torch.isfinite(x[torch.arange(64), got])) and got[0] == 10 and got[1] == int(probs[1].nonzero().max())
    monkeypatch.setattr(kernels, "native_library", lambda: None)
    assert (kernels.sample_rows(x, inv_t, u) == want).float().mean() > 0.95


def test_a_seeded_row_draws_the_same_beside_greedy_rows_sampled_rows_or_alone():
    # An all-sampled batch goes to the kernel without a copy or an argmax, a mixed one through
    # both; the kernel on the pool's threads (as after a native forward) or OpenMP's: the seeded
    # row's tokens do not change with any of them, over a vocabulary with a tail past the spans.
    vocab, steps = 49152 + 37, 6
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits[1:] = logits[0]  # the seeded row's logits wherever it sits

    def draws(batch, row, threads):
        reqs = [request(PROMPT, [], seed=11 if i == row else i, **p) for i, p in enumerate(batch)]
        with threads():
            return [Sampler()(logits[:len(reqs)].clone(), reqs)[0][row] for _ in range(steps)]

    sampled = dict(temperature=0.9)
    alone = draws([sampled], 0, kernels.pool_threads)
    assert len(set(alone)) > 1  # really sampled, not one token
    assert draws([{}, sampled, {}], 1, kernels.pool_threads) == alone
    assert draws([sampled] * 4, 2, kernels.pool_threads) == alone
    assert draws([sampled] * 4, 3, contextlib.nullcontext) == alone


def test_the_top_p_kernel_keeps_what_the_sort_keeps():
    # Rows whose boundary bucket holds one token or thousands (flat), with removed tokens and a
    # top_p of 1 (left alone): the same tokens stay as with the whole-vocabulary sort.
    gen = torch.Generator().manual_seed(9)
    x = torch.cat([torch.randn(3, 8000, generator=gen) * 5, torch.randn(3, 8000, generator=gen) * 0.01,
                   torch.randn(2, 8000, generator=gen)])
    x[6, ::3] = float("-inf")
    top_p = torch.tensor([0.9, 0.5, 0.999, 0.9, 0.3, 0.99, 0.8, 1.0])
    ours = x.clone()
    assert kernels.top_p_rows(ours, top_p)
    want = _mask_top_k_top_p_sorted(x.clone(), torch.full((8,), 8000), top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    assert torch.equal(ours[7], x[7])


def test_staged_sampling_values_draw_what_plain_ones_draw():
    """The GPU's path: every per-request value through pinned staging buffers (run here on host
    buffers) gives the tokens and log-probabilities of the plain path, over rows that use every
    transform at once, for several steps (the buffers taken in turn)."""
    from tritone.executor.staging import HostStaging

    def batch(step):
        return [request(PROMPT, OUTPUT, seed=step, repetition_penalty=1.3, frequency_penalty=0.5,
                        bad_token_ids=[[41, 12]], logit_bias={5: 3.0}, return_log_probs=True),
                request(PROMPT, OUTPUT[:2], seed=step + 1, min_tokens=5, return_log_probs=True),
                *(request(PROMPT, OUTPUT, seed=step + 2 + i, presence_penalty=0.3, return_log_probs=True, **w)
                  for i, w in enumerate(WARPS)),
                request(PROMPT, OUTPUT, seed=step + 9, temperature=0.0, return_log_probs=True)]

    staged = Sampler(HostStaging(torch.device("cpu"), 1 << 22, pinned=True))
    assert staged.staging.staged
    for step in range(3):
        logits = random_logits(len(batch(step)), seed=10 + step)
        assert staged(logits.clone(), batch(step)) == Sampler()(logits.clone(), batch(step))
