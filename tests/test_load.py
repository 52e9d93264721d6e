"""The load protocol: its statistics and prompts, then a short run against the real server."""

import math
import statistics

import pytest

from tritone_bench.load import markdown_table, measure_level
from tritone_bench.metrics import ServerMetrics
from tritone_bench.stats import Record, level_stats, summarize
from tritone_bench.streams import GrpcStreams
from tritone_bench.workload import PromptFactory, Workload, chat_lengths


def test_summarize_gives_mean_and_percentiles():
    s = summarize(range(1, 101))
    assert s["mean"] == 50.5
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in summarize([]).values())


def test_chat_lengths_are_seeded_bounded_and_long_tailed():
    pairs = chat_lengths(5000, seed=1, max_prompt=4000, max_output=1000)
    assert pairs == chat_lengths(5000, seed=1, max_prompt=4000, max_output=1000)
    prompts = [p for p, _ in pairs]
    outputs = [o for _, o in pairs]
    assert 1 <= min(prompts) and max(prompts) <= 4000 and 1 <= min(outputs) and max(outputs) <= 1000
    # Long-tailed: the mean sits well above the median, and a few requests are many times longer.
    assert statistics.fmean(prompts) > 1.3 * statistics.median(prompts)
    assert max(prompts) > 8 * statistics.median(prompts)


@pytest.mark.parametrize("length", [2, 64, 2000])
def test_prompts_have_the_exact_token_length(tokenizer, length):
    factory = PromptFactory(tokenizer, seed=0)
    texts = [factory.make(length) for _ in range(3)]
    assert [len(tokenizer(t).input_ids) for t in texts] == [length] * 3
    assert len(set(texts)) == 3  # different prompts, so no prefix-cache hits between them


def test_prompts_are_seeded(tokenizer):
    assert PromptFactory(tokenizer, seed=5).make(50) == PromptFactory(tokenizer, seed=5).make(50)


def test_level_stats_count_only_the_window():
    # Window [10, 20): a request from 9 to 12 (4 tokens, one response each second), one from 12
    # to 22 that streams 3 tokens at 13, 15 and 21, and one that failed.
    early = Record(start=9.0, max_tokens=4, chunks=[(9.5, 1), (10.5, 2), (11.5, 3), (12.0, 4)], end=12.0)
    late = Record(start=12.0, max_tokens=3, chunks=[(13.0, 1), (15.0, 2), (21.0, 3)], end=21.0)
    failed = Record(start=14.0, max_tokens=3, end=14.5, error="boom")
    s = level_stats([early, late, failed], (10.0, 20.0), ttft_target=0.6, tpot_target=1.0)
    assert s["output_tokens_per_s"] == pytest.approx((3 + 2) / 10)
    assert s["num_finished"] == 1 and s["requests_per_s"] == pytest.approx(0.1) and s["num_errors"] == 1
    assert sorted([s["itl_s"]["p50"]]) == [pytest.approx(1.0)]
    assert s["ttft_s"]["mean"] == pytest.approx(1.0)  # only `late` started in the window
    assert s["e2e_s"]["mean"] == pytest.approx(3.0)
    assert s["goodput_requests_per_s"] == pytest.approx(0.1)  # `early`: TTFT 0.5 s, 0.83 s per token
    strict = level_stats([early, late], (10.0, 20.0), ttft_target=0.4)
    assert strict["goodput_requests_per_s"] == 0.0


def test_a_response_that_carries_k_tokens_counts_k_gaps():
    # One token at 1.0, then a response with three more at 1.6: three gaps of 0.2 s, not one of 0.6.
    r = Record(start=0.5, max_tokens=4, end=1.6)
    for when, count in ((1.0, 1), (1.0, 1), (1.6, 4), (1.6, 4)):
        r.add(when, count)  # responses that carry no new token are not chunks
    s = level_stats([r], (0.0, 2.0))
    assert r.chunks == [(1.0, 1), (1.6, 4)] and s["ttft_s"]["mean"] == pytest.approx(0.5)
    assert s["itl_s"]["mean"] == pytest.approx(0.2) and s["itl_s"]["p99"] == pytest.approx(0.2)
    assert s["tokens_per_response"] == pytest.approx(2.0)


def test_markdown_table_has_a_row_per_level():
    s = level_stats([Record(start=0.0, max_tokens=1, chunks=[(0.5, 1)], end=0.5)], (0.0, 1.0))
    s.update(concurrency=4, forward_busy=0.5)
    table = markdown_table([("a", s), ("b", s)]).splitlines()
    assert len(table) == 4 and table[2].startswith("| a | 4 | 1.0 |") and table[2].endswith("| 0.50 |")


@pytest.mark.integration
class OneSecondTree:
    """A process tree whose one process spends one CPU second over the load."""

    def __init__(self):
        self.readings = iter([{"server": 10.0}, {"server": 11.0}])

    def cpu_seconds(self) -> dict[str, float]:
        return next(self.readings)


def test_a_short_run_against_the_server(server, tokenizer):
    workload = Workload.fixed(PromptFactory(tokenizer), 8, prompt_tokens=20, output_tokens=4)
    metrics = ServerMetrics(f"http://{server.args.host}:{server.args.metrics_port}/metrics")
    url = f"{server.args.host}:{server.args.grpc_port}"
    s = measure_level(GrpcStreams(url), workload, 3, duration=2.0, warmup=0.5, metrics=metrics, tree=OneSecondTree(),
                      progress=False)
    assert s["num_errors"] == 0 and s["num_finished"] >= 3
    # The CPU, read before and after the whole load, is per token of the whole load, warm-up and
    # drain included, not of the window alone.
    assert s["load_output_tokens"] % 4 == 0 and s["load_output_tokens"] > s["num_output_tokens"]
    assert s["cpu_ms_per_token"]["server"] == pytest.approx(1000.0 / s["load_output_tokens"])
    # Every finished request made its 4 tokens; tokens/s agrees with the requests finished.
    assert s["output_tokens_per_s"] >= 4 * (s["num_finished"] - 3) / s["window_s"]
    assert s["ttft_s"]["p50"] > 0 and s["e2e_s"]["p50"] >= s["ttft_s"]["p50"]
    assert 0.0 < s["forward_busy"] <= 1.0
