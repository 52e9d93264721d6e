"""The engine against Hugging Face `generate` on the real default model (CPU, fp32)."""

import threading
import time

import pytest
import torch
from transformers import AutoConfig

from conftest import PROMPTS, hf_greedy
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.executor import kv_bytes_per_token
from tritone.executor.attention import TorchSDPAAttention
from tritone.scheduling.request import FinishReason, SamplingParams

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


def test_requests_sent_together_with_one_prompt_compute_its_full_blocks_once(model_dir, prompt_ids, expected):
    """n choices arrive as n requests in one step: the first computes the prompt, the others wait
    for its full blocks to be published and take them from the prefix cache."""
    ids, want = prompt_ids[-1], expected[-1]
    engine = make_engine(model_dir, block_size=16)
    for i in range(4):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS))
    got = {str(i): [] for i in range(4)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert all(tokens == want for tokens in got.values())
    full = (len(ids) - 1) // 16 * 16  # a request always computes its last token itself
    assert engine.stats.num_prompt_tokens == len(ids) + 3 * (len(ids) - full)


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


def test_persistent_block_tables_follow_the_requests_blocks(model_dir, prompt_ids, expected):
    """Each step's block table is gathered from rows kept since earlier steps: under preemption,
    prefix hits and more requests over time than rows, it must equal every scheduled request's
    block list where the step reads it."""
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)
    engine = make_engine(model_dir, block_size=4, kv_cache_bytes=28 * 4 * per_token, max_num_seqs=6)
    prepare, checked = engine.runner.prepare, []

    def checking_prepare(batch, sample_rows):
        model_input = prepare(batch, sample_rows)
        tables, seq_lens = model_input.tables, model_input.seq_lens
        for i, item in enumerate(batch.scheduled):
            n = -(-int(seq_lens[i]) // 4)
            assert tables[i, :n].tolist() == item.request.block_ids[:n]
            checked.append(item.request.block_table_row)
        return model_input

    engine.runner.prepare = checking_prepare
    assert run_staggered(engine, prompt_ids, every=1) == expected
    assert engine.scheduler.num_preemptions > 0 and set(checked) == set(range(6))


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
    from tritone.engine.async_engine import merge_outputs
    from tritone.scheduling.request import RequestOutput

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


def test_merged_outputs_keep_every_tokens_top_log_probs_and_the_prompts_scores():
    from tritone.engine.async_engine import merge_outputs
    from tritone.scheduling.request import RequestOutput, TopLogProbs

    def top(i):
        return TopLogProbs(-float(i), [i], [-float(i)])

    first = RequestOutput("a", [1], [-1.0], 3, 1, False, new_top_log_probs=[top(1)], prompt_top_log_probs=[top(9)])
    second = RequestOutput("a", [2, 3], [-2.0, -3.0], 3, 3, False, new_top_log_probs=[top(2), top(3)])
    [merged] = merge_outputs([first, second])
    assert merged.new_top_log_probs == [top(1), top(2), top(3)]
    assert merged.prompt_top_log_probs == [top(9)]
    [plain] = merge_outputs([RequestOutput("b", [1], [0.0], 3, 1, False), RequestOutput("b", [2], [0.0], 3, 2, False)])
    assert plain.new_top_log_probs is None and plain.prompt_top_log_probs is None


class Collector:
    """An AsyncEngine's on_output: keeps every output, by request, and can fail chosen sends."""

    def __init__(self, fail_first_of=()):
        self.outputs: dict[str, list] = {}
        self.fail_first_of = set(fail_first_of)
        self.fatal = []

    def __call__(self, output):
        if output.request_id in self.fail_first_of:
            self.fail_first_of.discard(output.request_id)
            raise RuntimeError("injected send fault")
        self.outputs.setdefault(output.request_id, []).append(output)

    def finals(self, request_id):
        return [o for o in self.outputs.get(request_id, []) if o.finished]

    def tokens(self, request_id):
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def wait_final(self, *request_ids, timeout=120.0):
        deadline = time.monotonic() + timeout
        while not all(self.finals(r) for r in request_ids):
            assert time.monotonic() < deadline, f"no final response for {request_ids}"
            time.sleep(0.01)


_started: list = []


def start_async(engine, collector):
    from tritone.engine.async_engine import AsyncEngine

    # Built before, so that a test can break it first: the engine thread only takes it.
    async_engine = AsyncEngine(lambda: engine, collector, on_fatal=collector.fatal.append)
    _started.append(async_engine)
    return async_engine


@pytest.fixture(autouse=True)
def _stop_async_engines():
    """Stops what a test started, dead or not: a sender thread left waiting holds its engine (a
    gigabyte of weights) for the rest of the session."""
    yield
    while _started:
        _started.pop().stop(timeout=0)


def wait_idle(engine, timeout=60.0):
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failed_step_fails_every_request_frees_every_block_and_leaves_no_hash(model_dir, prompt_ids, expected,
                                                                                monkeypatch):
    engine = make_engine(model_dir)
    collector = Collector()

    def broken_run(model_input, sampling, prev=None):
        raise RuntimeError("injected step fault")

    monkeypatch.setattr(engine.runner, "execute_model", broken_run)
    async_engine = start_async(engine, collector)
    long_ids = [str(i) for i in range(12, 16)]
    for rid in long_ids:
        async_engine.submit(rid, prompt_ids[int(rid)], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final(*long_ids)
    for rid in long_ids:
        (final,) = collector.finals(rid)
        assert final.finish_reason == FinishReason.ERROR and "injected step fault" in final.error
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.cached_blocks
    # The same prompt again finds no block that the failed step was to compute.
    monkeypatch.undo()
    async_engine.submit("again", prompt_ids[15], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final("again")
    assert collector.tokens("again") == expected[15]
    assert collector.finals("again")[0].finish_reason != FinishReason.ERROR
    async_engine.stop()
    assert async_engine.dead is None and not collector.fatal


def test_a_sticky_device_error_is_fatal_so_that_the_process_restarts(model_dir, prompt_ids, monkeypatch):
    """A CUDA error such as an illegal address fails every later step on its context: rather than
    fail requests one step at a time forever, the engine dies and says so (on_fatal ends the llm
    model's process, and the launcher restarts the server)."""
    engine = make_engine(model_dir)
    collector = Collector()

    def lost(model_input, sampling, prev=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute_model", lost)
    async_engine = start_async(engine, collector)
    async_engine.submit("a", prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final("a")
    (final,) = collector.finals("a")
    assert final.finish_reason == FinishReason.ERROR and "illegal memory access" in final.error
    deadline = time.monotonic() + 10
    while not collector.fatal and time.monotonic() < deadline:
        time.sleep(0.01)
    assert collector.fatal and "the process must restart" in collector.fatal[0]
    with pytest.raises(RuntimeError, match="the engine is not running"):
        async_engine.submit("b", prompt_ids[1], SamplingParams(max_tokens=MAX_TOKENS))


def test_the_engine_is_built_on_its_own_thread_and_what_building_raised_is_raised(model_dir, prompt_ids, expected):
    from tritone.engine.async_engine import AsyncEngine

    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return make_engine(model_dir)

    collector = Collector()
    async_engine = AsyncEngine(build, collector)
    assert built_on == [async_engine._engine_thread]
    async_engine.submit("a", prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final("a")
    async_engine.stop()
    assert collector.tokens("a") == expected[0]

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken, collector)


def test_a_send_that_raises_still_ends_the_request_with_one_final_error(model_dir, prompt_ids, expected):
    # "mid" fails on its first (not final) output, "last" on its final one; "other" is unharmed.
    engine = make_engine(model_dir)
    collector = Collector(fail_first_of={"mid", "last"})
    async_engine = start_async(engine, collector)
    async_engine.submit("mid", prompt_ids[1], SamplingParams(max_tokens=50, end_id=-1))
    async_engine.submit("last", prompt_ids[2], SamplingParams(max_tokens=1))
    async_engine.submit("other", prompt_ids[3], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final("mid", "last", "other")
    wait_idle(engine)
    async_engine.stop()
    for rid in ("mid", "last"):
        (final,) = collector.finals(rid)
        assert final.finish_reason == FinishReason.ERROR and "injected send fault" in final.error
        assert len(collector.outputs[rid]) == 1  # nothing after the final response
    assert collector.tokens("other") == expected[3]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("fault", ["step raises SystemExit", "failing the requests raises too"])
def test_a_dead_engine_thread_fails_its_requests_refuses_new_ones_and_is_reported(model_dir, prompt_ids, monkeypatch,
                                                                                  fault):
    engine = make_engine(model_dir)
    collector = Collector()
    started = threading.Event()

    def broken_run(model_input, sampling, prev=None):
        started.wait()
        raise SystemExit(3) if fault.startswith("step") else RuntimeError("injected step fault")

    def broken_abort(*args, **kwargs):
        raise RuntimeError("injected abort fault")

    monkeypatch.setattr(engine.runner, "execute_model", broken_run)
    if not fault.startswith("step"):
        monkeypatch.setattr(engine, "abort_request", broken_abort)
    async_engine = start_async(engine, collector)
    for rid in ("a", "b"):
        async_engine.submit(rid, prompt_ids[int(rid == "b")], SamplingParams(max_tokens=MAX_TOKENS))
    time.sleep(0.2)
    started.set()
    collector.wait_final("a", "b")
    assert all(collector.finals(r)[0].finish_reason == FinishReason.ERROR for r in ("a", "b"))
    deadline = time.monotonic() + 10
    while not collector.fatal:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "engine thread died" in collector.fatal[0] and not async_engine.is_alive
    with pytest.raises(RuntimeError, match="not running"):
        async_engine.submit("late", prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_add_that_raises_fails_that_request_alone(model_dir, prompt_ids, expected, monkeypatch):
    engine = make_engine(model_dir)
    collector = Collector()
    real_add = engine.add_request

    def add(request_id, ids, params, **kwargs):
        if request_id == "bad":
            raise TypeError("injected add fault")
        return real_add(request_id, ids, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", add)
    async_engine = start_async(engine, collector)
    async_engine.submit("bad", prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    async_engine.submit("good", prompt_ids[4], SamplingParams(max_tokens=MAX_TOKENS))
    collector.wait_final("bad", "good")
    async_engine.stop()
    assert "injected add fault" in collector.finals("bad")[0].error
    assert collector.tokens("good") == expected[4] and async_engine.dead is None


def test_penalties_and_bans_run_on_the_runners_logits(model_dir, prompt_ids):
    # The runner returns inference-mode tensors; the sampler edits them in place.
    engine = _shared_engine(model_dir)
    params = SamplingParams(max_tokens=4, repetition_penalty=1.3, presence_penalty=0.5, bad_token_ids=[[198]],
                            end_id=-1)
    got = run_staggered(engine, prompt_ids[:2], lambda i: params)
    assert [len(g) for g in got] == [4, 4] and all(198 not in g for g in got)
