"""The engine against Hugging Face `generate` on the real default model (CPU, fp32)."""

import pytest
import torch
from transformers import AutoConfig

from conftest import PROMPTS, hf_greedy
from tritone.config import EngineConfig
from tritone.engine import LLMEngine
from tritone.executor import kv_bytes_per_token
from tritone.executor.attention import TorchSDPAAttention
from tritone.request import FinishReason, SamplingParams

MAX_TOKENS = 12


def make_engine(model_dir, **overrides):
    config = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=256)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def run_staggered(engine, prompts_ids, params_for=lambda i: SamplingParams(max_tokens=MAX_TOKENS), every=2):
    """Adds one request every `every` steps, so requests join a batch that is already decoding."""
    outputs = {str(i): [] for i in range(len(prompts_ids))}
    pending = list(enumerate(prompts_ids))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, ids = pending.pop(0)
            engine.add_request(str(i), ids, params_for(i))
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    return [outputs[str(i)] for i in range(len(prompts_ids))]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    # 16 prompts of different lengths: the base prompts, and each with a longer lead-in.
    base = [tokenizer(p).input_ids for p in PROMPTS]
    lead = tokenizer("Here is a sentence to continue. ").input_ids
    return base + [lead * (i + 1) + ids for i, ids in enumerate(base)]


@pytest.fixture(scope="module")
def expected(hf_model, prompt_ids):
    return [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_staggered_greedy_batch_equals_hf_alone(model_dir, prompt_ids, expected, prefix_caching):
    engine = make_engine(model_dir, enable_prefix_caching=prefix_caching)
    got = run_staggered(engine, prompt_ids)
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_torch_decode_attention_path_equals_hf(model_dir, prompt_ids, expected):
    # The gather-then-SDPA path that CUDA (and CPUs without a C compiler) take.
    engine = make_engine(model_dir)
    engine.runner.attention = TorchSDPAAttention()
    assert run_staggered(engine, prompt_ids) == expected


def test_preemption_under_a_tiny_cache_keeps_answers(model_dir, prompt_ids, expected):
    # 48 blocks of 4 tokens cannot hold 16 requests at once: admission fills the cache, decodes
    # then outgrow it, and the newest requests are preempted and recomputed.
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)
    engine = make_engine(model_dir, block_size=4, kv_cache_bytes=48 * 4 * per_token, enable_prefix_caching=False)
    assert engine.block_manager.num_blocks == 48
    got = run_staggered(engine, prompt_ids, every=1)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chunked_prefill_of_a_prompt_longer_than_the_budget(model_dir, hf_model, tokenizer):
    ids = tokenizer(" ".join(PROMPTS)).input_ids
    assert len(ids) > 64
    engine = make_engine(model_dir, max_num_batched_tokens=32)
    got = run_staggered(engine, [ids, tokenizer(PROMPTS[0]).input_ids])
    assert got[0] == hf_greedy(hf_model, ids, MAX_TOKENS)


def test_seeded_sample_is_the_same_alone_and_in_a_full_batch(model_dir, prompt_ids):
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=1234, end_id=-1)
    alone = run_staggered(make_engine(model_dir), [prompt_ids[3]], lambda i: sampled)[0]
    params = lambda i: sampled if i == 5 else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i)
    batch = run_staggered(make_engine(model_dir), prompt_ids[:5] + [prompt_ids[3]] + prompt_ids[6:], params, every=1)
    assert batch[5] == alone
    assert len(alone) == MAX_TOKENS


def test_max_tokens_is_exact_when_end_of_sequence_is_ignored(model_dir, prompt_ids):
    engine = make_engine(model_dir)
    got = run_staggered(engine, prompt_ids[:4], lambda i: SamplingParams(max_tokens=5 + i, end_id=-1))
    assert [len(g) for g in got] == [5, 6, 7, 8]


def test_abort_frees_blocks_at_once(model_dir, prompt_ids):
    engine = make_engine(model_dir)
    engine.add_request("a", prompt_ids[0], SamplingParams(max_tokens=50, end_id=-1))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort_request("a")
    assert out.finished and out.finish_reason == FinishReason.CANCELLED
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("field,params", [
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("temperature", SamplingParams(temperature=-1.0)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_k", SamplingParams(top_k=-1)),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
    ("end_id", SamplingParams(end_id=10**9)),
])
def test_bad_parameters_are_refused_naming_the_field(model_dir, field, params):
    engine = _shared_engine(model_dir)
    with pytest.raises(ValueError, match=field):
        engine.add_request("x", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_the_limit_is_refused(model_dir):
    engine = _shared_engine(model_dir)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=engine.max_model_len))


_ENGINES = {}


def _shared_engine(model_dir):
    if "e" not in _ENGINES:
        _ENGINES["e"] = make_engine(model_dir)
    return _ENGINES["e"]


def test_merged_outputs_keep_each_requests_tokens_in_order():
    from tritone.engine import merge_outputs
    from tritone.request import RequestOutput

    def out(rid, ids, n, finished=False):
        return RequestOutput(rid, ids, [0.5] * len(ids), 3, n, finished,
                             FinishReason.LENGTH if finished else None)

    merged = merge_outputs([out("a", [1], 1), out("b", [7], 1), out("a", [2], 2),
                            out("b", [8, 9], 3), out("a", [3], 3, finished=True)])
    assert [m.request_id for m in merged] == ["a", "b"]
    a, b = merged
    assert (a.new_token_ids, a.new_log_probs, a.num_output_tokens) == ([1, 2, 3], [0.5] * 3, 3)
    assert a.finished and a.finish_reason == FinishReason.LENGTH
    assert (b.new_token_ids, b.num_output_tokens, b.finished) == ([7, 8, 9], 3, False)
