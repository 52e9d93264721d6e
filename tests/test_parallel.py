"""Tensor and data parallelism on the CPU (gloo): every rank a real worker process.

TP=2 must equal TP=1 token for token in fp32, on tiny Llama 3 / Qwen2 (biases) / Qwen3 (q/k norm)
checkpoints and on the default model (9 query heads and 3 KV heads: split 2 + 1), alone and
batched with staggered arrivals, prefix caching, chunked prefill and preemption, on the native
and the torch forwards. A killed rank ends every request its engine held with an error, and the
engine restarts and serves again. Misconfigured sizes are refused naming the flag. Data
parallelism: requests spread over the engines and a prompt's prefix stays where it is cached.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from test_executor import build_tiny
from tritone.config import EngineConfig
from tritone.engine.async_engine import AsyncEngine
from tritone.engine.core import LLMEngine
from tritone.engine.data_parallel import DataParallelEngine, prompt_block_hashes
from tritone.executor import tensor_parallel
from tritone.executor.multiproc import RemoteRunner
from tritone.scheduling.request import FinishReason, SamplingParams


def workload(vocab: int) -> list[tuple[int, list[int], int]]:
    """(step at which it arrives, prompt, max_tokens): staggered, one prompt repeated (a prefix
    hit), prompts longer than a step's token budget (chunked prefill)."""
    gen = torch.Generator().manual_seed(3)
    p = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 37, 23, 3, 41)]
    return [(0, p[0], 12), (0, p[1], 10), (2, p[2], 14), (3, p[1] + p[3], 9), (5, p[4], 12), (9, p[0] + p[2], 8)]


def run(engine: LLMEngine, items) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    step = 0
    pending = list(enumerate(items))
    while pending or engine.has_unfinished_requests():
        for i, (at, ids, max_tokens) in [x for x in pending if x[1][0] <= step]:
            engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, end_id=-1))
            outputs[str(i)] = []
        pending = [x for x in pending if x[1][0] > step]
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs


def engine_of(path, **overrides) -> LLMEngine:
    config = dict(model=str(path), dtype="float32", kv_cache_bytes=8 << 20, block_size=4, max_num_batched_tokens=16)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))[1]


def test_tp2_equals_tp1_on_tiny_models_batched_staggered_chunked_and_cached(tiny):
    items = workload(384)
    want = run(engine_of(tiny), items)
    engine = engine_of(tiny, tensor_parallel_size=2)
    try:
        assert isinstance(engine.runner, RemoteRunner) and len(engine.runner.worker_pids) == 2
        assert run(engine, items) == want
        assert engine.block_manager.prefix_stats.num_hit > 0  # the repeated prompts hit the cache
    finally:
        engine.shutdown()


def test_tp2_equals_tp1_under_preemption_on_the_torch_forward(tmp_path):
    path = build_tiny("qwen3", tmp_path / "qwen3")[1]
    items = workload(384)
    # A KV cache of 24 blocks of 4 tokens: the batch does not fit, requests are preempted.
    small = dict(kv_cache_bytes=24 * 4 * 2 * 2 * 2 * 16 * 4, forward="torch", compile="off")
    reference = engine_of(path, **small)
    want = run(reference, items)
    assert reference.scheduler.num_preemptions > 0
    engine = engine_of(path, tensor_parallel_size=2, **{**small, "kv_cache_bytes": small["kv_cache_bytes"]})
    try:
        assert run(engine, items) == want
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()


def test_tp2_equals_tp1_on_the_default_model_with_uneven_heads(model_dir):
    shard = tensor_parallel.make_shard(1, 2, num_heads=9, num_kv_heads=3, intermediate=1536, vocab=49152)
    assert (shard.kv_heads, shard.q_heads, shard.intermediate, shard.vocab) == ((2, 1), (6, 3), (768, 768),
                                                                             (24576, 24576))
    items = [(at, ids, 6) for at, ids, _ in workload(49152)[:4]]
    overrides = dict(kv_cache_bytes=64 << 20, block_size=16, max_num_batched_tokens=32)
    want = run(engine_of(model_dir, **overrides), items)
    engine = engine_of(model_dir, tensor_parallel_size=2, **overrides)
    try:
        assert run(engine, items) == want
    finally:
        engine.shutdown()


# Sampled requests of every kind: seeded and not (the engine draws those seeds), penalties and bad
# words (which read the output kept where sampling runs), min_tokens, top-k/p, min-p, log-probabilities.
SAMPLED = [dict(temperature=0.8, seed=7), dict(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.3),
           dict(temperature=0.7, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3, seed=11),
           dict(bad_token_ids=[[5], [7, 9]], min_tokens=4, temperature=0.9, seed=5),
           dict(temperature=1.2, seed=3, return_log_probs=True), dict(return_log_probs=True)]


def run_sampled(engine: LLMEngine, items) -> dict[str, tuple[list[int], list[float]]]:
    got: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    pending = list(enumerate(items))
    while pending or engine.has_unfinished_requests():
        for i, (at, ids, max_tokens) in [x for x in pending if x[1][0] <= step]:
            engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, end_id=-1,
                                                           **SAMPLED[i % len(SAMPLED)]))
            got[str(i)] = ([], [])
        pending = [x for x in pending if x[1][0] > step]
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_log_probs)
        step += 1
    return got


def test_sampling_in_a_worker_draws_what_it_draws_in_the_engines_process(tmp_path):
    # The sampler runs where the logits are: in the engine's process at one rank, in the worker
    # of a data-parallel engine. A request's tokens are the same either way.
    path = build_tiny("llama3", tmp_path / "llama3")[1]
    items = workload(384)
    want = run_sampled(engine_of(path, num_threads=1), items)
    assert any(len(set(tokens)) > 3 for tokens, _ in want.values())
    engine = engine_of(path, num_threads=1, data_parallel_size=2)
    try:
        assert isinstance(engine.runner, RemoteRunner) and len(engine.runner.worker_pids) == 1
        got = run_sampled(engine, items)
    finally:
        engine.shutdown()
    assert {k: tokens for k, (tokens, _) in got.items()} == {k: tokens for k, (tokens, _) in want.items()}
    for k, (_, log_probs) in got.items():
        assert log_probs == pytest.approx(want[k][1], abs=1e-4)
        if SAMPLED[int(k) % len(SAMPLED)].get("return_log_probs"):
            assert log_probs and all(lp <= 0 for lp in log_probs) and any(lp < 0 for lp in log_probs)


def test_sizes_that_cannot_run_are_refused_naming_the_flag(tmp_path):
    path = build_tiny("qwen2", tmp_path / "qwen2")[1]  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the model has 2 KV heads"):
        engine_of(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 --data-parallel-size 64: 128 ranks need as many CPUs"):
        engine_of(path, tensor_parallel_size=2, data_parallel_size=64)
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        engine_of(path, tensor_parallel_size=0)
    gemma = build_tiny("gemma", tmp_path / "gemma")[1]
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: the Hugging Face fallback model .* one device only"):
        engine_of(gemma, tensor_parallel_size=2)


class Collector:
    def __init__(self):
        self.outputs: dict[str, list] = {}
        self.cond = threading.Condition()

    def __call__(self, output):
        with self.cond:
            self.outputs.setdefault(output.request_id, []).append(output)
            self.cond.notify_all()

    def wait(self, predicate, timeout=120.0):
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.outputs), timeout), self.outputs.keys()

    def tokens(self, request_id):
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def final(self, request_id):
        return self.outputs[request_id][-1]


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_killed_or_hung_rank_fails_its_requests_and_the_engine_serves_again(model_dir, monkeypatch, fault):
    from tritone.executor import multiproc

    # The step watchdog, shortened: a stopped rank holds the other in a collective for good.
    monkeypatch.setattr(multiproc, "STEP_TIMEOUT_SECONDS", 3.0)
    config = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=512 << 20, tensor_parallel_size=2)
    collector = Collector()
    engine = AsyncEngine(lambda: LLMEngine(config), collector)
    try:
        prompt = list(range(100, 120))
        for i in range(2):
            engine.submit(f"long{i}", prompt, SamplingParams(max_tokens=2000, end_id=-1))
        collector.wait(lambda outs: all(len(outs.get(f"long{i}", [])) >= 2 for i in range(2)))
        os.kill(engine.engine.runner.worker_pids[1], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        collector.wait(lambda outs: all(outs[f"long{i}"][-1].finished for i in range(2)), timeout=30)
        why = "model worker 1 of engine 0" if fault == "killed" else "did not finish a step within 3 s"
        for i in range(2):
            final = collector.final(f"long{i}")
            assert final.finish_reason == FinishReason.ERROR and why in final.error, final.error
        # Rebuilt: new workers, the same answers as a fresh engine's.
        engine.submit("after", prompt, SamplingParams(max_tokens=8, end_id=-1))
        collector.wait(lambda outs: "after" in outs and outs["after"][-1].finished, timeout=120)
        assert collector.final("after").error is None
        before = collector.tokens("long0")[:8]  # what the first engine made before the kill
        assert len(before) >= 2 and collector.tokens("after")[:len(before)] == before
        assert engine.num_restarts == 1 and engine.is_alive
    finally:
        engine.stop(timeout=5)
    assert not engine.engine.runner.worker_pids  # the workers are gone


def test_data_parallel_engines_spread_requests_and_keep_prefixes(tmp_path):
    path = build_tiny("llama3", tmp_path / "llama3")[1]
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                          data_parallel_size=2)
    collector = Collector()
    dp = DataParallelEngine([lambda i=i: LLMEngine(config, i) for i in range(2)], collector)
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 384, (12,), generator=gen).tolist() for _ in range(6)]
        for i, ids in enumerate(prompts):
            dp.submit(str(i), ids, SamplingParams(max_tokens=6, end_id=-1))
        collector.wait(lambda outs: all(str(i) in outs and outs[str(i)][-1].finished for i in range(6)))
        counts = [e.engine.stats.num_generation_tokens for e in dp.engines]
        assert all(c > 0 for c in counts), counts  # a burst lands on both engines
        # A prompt that extends an earlier one goes where that one's blocks are.
        owner = dp.route(prompts[0] + [7, 8, 9, 10, 11])
        assert owner == dp.route(prompts[0])
        # Both engines hold the same model: the same greedy answer wherever a prompt runs.
        reference = engine_of(path, kv_cache_bytes=8 << 20)
        want = run(reference, [(0, prompts[0], 6)])
        assert collector.tokens("0") == want["0"]
        assert dp._owner == {}  # every finished request forgotten
    finally:
        dp.stop(timeout=5)


def test_prompt_block_hashes_are_equal_exactly_where_prefixes_are():
    a = prompt_block_hashes(list(range(10)), 4)
    b = prompt_block_hashes(list(range(8)) + [99, 98, 97, 96], 4)
    c = prompt_block_hashes([5] + list(range(1, 10)), 4)
    assert len(a) == 2 and a == b[:2] and len(b) == 3
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every hash after it


def test_split_and_shard_tensor():
    assert [tensor_parallel.split(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    shard = tensor_parallel.make_shard(1, 2, num_heads=4, num_kv_heads=2, intermediate=6, vocab=7)
    w = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    embed = tensor_parallel.shard_tensor("model.embed_tokens.weight", w, shard, head_dim=2)
    assert embed.shape == (4, 3) and torch.equal(embed[:3], w[4:]) and not embed[3].any()  # padded
    o = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8)  # [hidden, 4 heads * head_dim 2]
    assert torch.equal(tensor_parallel.shard_tensor("model.layers.0.self_attn.o_proj.weight", o, shard, 2), o[:, 4:])
    assert tensor_parallel.shard_tensor("model.layers.0.mlp.down_proj.bias", torch.ones(3), shard, 2) is None


def test_a_rank_that_fails_to_start_fails_the_start_at_once_while_another_waits():
    """Rank 1 reports its failure while rank 0 says nothing (waiting for rank 1 in a collective, as
    it would): the start fails at once, naming rank 1, instead of waiting on rank 0 forever."""
    import multiprocessing

    from tritone.executor.multiproc import RemoteRunner

    runner = RemoteRunner.__new__(RemoteRunner)
    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    runner._conns, runner.engine_index, runner._procs = [ours for ours, _ in pipes], 0, []
    pipes[1][1].send(("error", "RuntimeError: out of memory"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="model worker 1 failed while starting: RuntimeError: out of memory"):
        runner._await_start()
    assert time.monotonic() - t0 < 5
