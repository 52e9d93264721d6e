from tritone.config import EngineConfig
from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.request import FinishReason, Request, RequestStatus, SamplingParams
from tritone.scheduling.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=32, max_seqs=8, prefix=True):
    config = EngineConfig(model="unused", max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=block_size)
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(config, bm, max_model_len=1024), bm


def req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=8))


def run_step(sched, out, new_token=7):
    """What the engine does after the model ran: catch up, append a token where a row completed."""
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_tokens
        sched.block_manager.cache_computed_blocks(item.request)
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.output_ids.append(new_token)


def test_budget_chunks_a_long_prompt_and_mixes_it_with_decodes():
    sched, _ = make(num_blocks=64, budget=10)
    short = req("short", 3)
    sched.add(short)
    run_step(sched, sched.schedule())
    long = req("long", 25, start=100)
    sched.add(long)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("short", 1), ("long", 9)]
    run_step(sched, out)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("short", 1), ("long", 9)]
    run_step(sched, out)
    out = sched.schedule()
    assert dict((s.request.request_id, s.num_tokens) for s in out.scheduled) == {"short": 1, "long": 7}
    run_step(sched, out)
    assert long.num_computed_tokens == 25 and long.output_ids == [7]


def test_fcfs_admission_stops_when_blocks_run_out():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    for i in range(3):
        sched.add(req(f"r{i}", 6, start=10 * i))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = req("a", 8), req("b", 8, start=100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # both need a new block for their 9th token: b (newest) goes
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    # b keeps its generated token and recomputes prompt plus output once a finishes, less the
    # head block that stayed cached (the tail was evicted first, for a's new block).
    run_step(sched, out)
    sched.finish(a, FinishReason.LENGTH)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("b", 5)]
    assert b.num_cached_tokens == 4 and b.num_tokens == 9


def test_prefix_hit_skips_computed_tokens():
    sched, bm = make(num_blocks=16, block_size=4, budget=64)
    a = req("a", 10)
    sched.add(a)
    run_step(sched, sched.schedule())
    b = req("b", 10)
    sched.add(b)
    out = sched.schedule()
    item = next(s for s in out.scheduled if s.request is b)
    assert b.num_cached_tokens == 8 and item.num_tokens == 2


def test_finish_frees_blocks_on_every_path():
    sched, bm = make()
    running, waiting = req("run", 5), req("wait", 5, start=50)
    sched.add(running)
    sched.schedule()
    sched.add(waiting)
    sched.finish(running, FinishReason.CANCELLED)
    sched.finish(waiting, FinishReason.ERROR)
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_work
    assert running.finish_reason == FinishReason.CANCELLED and waiting.is_finished


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make(num_blocks=64, max_seqs=2)
    for i in range(4):
        sched.add(req(f"r{i}", 2, start=10 * i))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_prefix_hit_rate_counts_each_prompt_once():
    # b waits several steps for blocks, then is preempted once: still one prompt in the rate.
    from tritone.scheduling.scheduler import SchedulerOutput

    def compute_only(out):  # no new tokens: the holder keeps its blocks without growing
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            bm.cache_computed_blocks(item.request)

    sched, bm = make(num_blocks=6, block_size=4, budget=64)
    a = req("a", 12)
    sched.add(a)
    compute_only(sched.schedule())
    sched.finish(a, FinishReason.LENGTH)
    holder = req("holder", 16, start=500)
    sched.add(holder)
    compute_only(sched.schedule())
    b = req("b", 12)
    sched.add(b)
    for _ in range(3):
        compute_only(sched.schedule())
    assert b.status == RequestStatus.WAITING
    sched.finish(holder, FinishReason.LENGTH)
    compute_only(sched.schedule())
    assert b.status == RequestStatus.RUNNING and b.num_cached_tokens == 8
    sched._preempt(b, SchedulerOutput())
    compute_only(sched.schedule())
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 1
    stats = bm.prefix_stats
    assert (stats.num_queried, stats.num_hit) == (12 + 16 + 12, 8)


def test_hit_rate_is_over_a_window_of_recent_prompts():
    from tritone.scheduling.block_manager import PrefixCacheStats

    stats = PrefixCacheStats(window=2)
    stats.record(10, 10)
    stats.record(10, 0)
    stats.record(10, 5)
    assert stats.hit_rate == 0.25


def test_under_heavy_preemption_only_running_requests_are_scheduled():
    # The scheduler filters nothing after the fact: preemption takes the newest first, so it
    # never reaches back to a request already scheduled this step.
    import random

    rng = random.Random(0)
    sched, bm = make(num_blocks=12, block_size=2, budget=16, max_seqs=8)
    for i in range(12):
        sched.add(req(f"r{i}", rng.randint(1, 7), start=100 * i))
    num_preempted = 0
    for _ in range(200):
        out = sched.schedule()
        num_preempted += len(out.preempted)
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        assert all(s.request.status == RequestStatus.RUNNING for s in out.scheduled)
        assert not {id(r) for r in out.preempted} & {id(s.request) for s in out.scheduled}
        run_step(sched, out)
        for r in list(sched.running):
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, FinishReason.LENGTH)
    assert num_preempted > 0 and not sched.has_work
    assert bm.num_free_blocks == bm.num_blocks
