"""The load protocol of every benchmark, and `tritone-load`, its command line against a running server.

A closed loop: `concurrency` streams, each sending its next request as soon as its last one
ends. A level ends after `num_requests` requests, all measured, or after a warm-up and a
measurement window of `duration` seconds, requests still running then finishing unmeasured (so
a level takes the same time whatever the server's speed). Every figure comes from `stats`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

from tritone_bench.metrics import ServerMetrics, step_breakdown
from tritone_bench.proc_cpu import ProcessTree, per_token_ms
from tritone_bench.stats import Record, level_stats, tokens_per_s
from tritone_bench.workload import PromptFactory, Workload


async def closed_loop(send, workload: Workload, concurrency: int, num_requests: int | None = None,
                      duration: float | None = None, warmup: float = 0.0, drain_timeout: float = 120.0,
                      label: str = "", progress: bool = True) -> tuple[list[Record], tuple[float, float]]:
    """Runs the workload through `send(record, text)`; returns the records and the measurement window."""
    from tqdm import tqdm

    if (num_requests is None) == (duration is None):
        raise ValueError("a level ends after a number of requests or a duration: give one of them")
    records: list[Record] = []
    order = itertools.count()
    start = time.perf_counter()
    stop_at = start + warmup + duration if duration is not None else float("inf")
    bar = tqdm(total=num_requests, desc=f"{label}concurrency {concurrency}", unit="req", leave=False,
               disable=not progress)

    async def stream():
        while time.perf_counter() < stop_at and (i := next(order)) < (num_requests or float("inf")):
            text, prompt_tokens, max_tokens = workload[i]
            record = Record(start=time.perf_counter(), max_tokens=max_tokens, prompt_tokens=prompt_tokens)
            records.append(record)
            await send(record, text)
            bar.update(1)

    work = asyncio.gather(*(stream() for _ in range(concurrency)))
    # Requests in flight when the window closes run to their end: cancelling them would be
    # faster, but a stream cancelled by the client leaves Triton's ensemble scheduler counting
    # it as in flight (the server then waits for it at exit), which would skew later levels.
    try:
        await asyncio.wait_for(work, timeout=None if duration is None else warmup + duration + drain_timeout)
    except asyncio.TimeoutError:
        pass
    bar.close()
    if duration is None:
        return records, (start, time.perf_counter())
    return records, (start + warmup, stop_at)


def measure_level(sender, workload: Workload, concurrency: int, *, num_requests: int | None = None,
                  duration: float | None = None, warmup: float = 0.0, metrics: ServerMetrics | None = None,
                  tree: ProcessTree | None = None, ttft_target: float = float("inf"),
                  tpot_target: float = float("inf"), label: str = "", progress: bool = True) -> dict:
    """One level: the load through `sender` (a `streams` class), its statistics, and where given,
    the engine's forward-busy fraction and step phases over the whole load period, warm-up and
    drain included (the engine is idle before and after, so its counters grow only within it),
    and the CPU per output token of each process of the server's tree."""

    async def load():
        async with sender as send:
            return await closed_loop(send, workload, concurrency, num_requests, duration, warmup,
                                     label=label, progress=progress)

    if metrics:
        metrics.wait_idle()
        before = metrics.read()
    cpu, t_before = tree.cpu_seconds() if tree else None, time.perf_counter()
    records, window = asyncio.run(load())
    load_seconds = time.perf_counter() - t_before
    stats = level_stats(records, window, ttft_target, tpot_target)
    stats["concurrency"] = concurrency
    stats["load_output_tokens"] = sum(r.num_output_tokens for r in records)
    if tree:
        # The CPU is read over the whole load, warm-up and drain included: per token of the whole
        # load too (the window's tokens alone overstated it by the drain's share, near half at 128).
        stats["cpu_ms_per_token"] = per_token_ms(cpu, tree.cpu_seconds(), stats["load_output_tokens"])
    if metrics:
        metrics.wait_idle()
        after = metrics.read()
        busy = after.get("tritone_forward_seconds_total", 0.0) - before.get("tritone_forward_seconds_total", 0.0)
        stats["forward_busy"] = min(1.0, busy / load_seconds)
        stats["step_ms"] = step_breakdown(before, after)
    return stats


# ---------------------------------------------------------------- tritone-load's table

TABLE_HEADER = ("| configuration | conc. | output tok/s | req/s | goodput req/s | TTFT p50 / p99 (s) "
                "| ITL p50 / p99 (ms) | E2E p50 / p99 (s) | forward-busy |\n|---|---|---|---|---|---|---|---|---|")


def table_row(label: str, s: dict) -> str:
    busy = f"{s['forward_busy']:.2f}" if "forward_busy" in s else ""
    t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
    return (f"| {label} | {s['concurrency']} | {tokens_per_s(s['output_tokens_per_s'])} | {s['requests_per_s']:.2f} "
            f"| {s['goodput_requests_per_s']:.2f} | {t['p50']:.3f} / {t['p99']:.3f} "
            f"| {1000 * i['p50']:.1f} / {1000 * i['p99']:.1f} | {e['p50']:.2f} / {e['p99']:.2f} | {busy} |")


def markdown_table(rows: list[tuple[str, dict]]) -> str:
    return "\n".join([TABLE_HEADER] + [table_row(label, s) for label, s in rows])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritone-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of the server (default 127.0.0.1:8001)")
    p.add_argument("--metrics-url", help="the server's metrics endpoint, for the forward-busy fraction "
                                         "(e.g. http://127.0.0.1:8002/metrics)")
    p.add_argument("--model", default="ensemble", help="model to call (default ensemble)")
    p.add_argument("--tokenizer", help="tokenizer directory for exact prompt lengths (default: the default model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1], help="closed-loop levels, e.g. 1 4 16")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--mix", choices=["fixed", "chat"], default="fixed",
                   help="fixed: every request the same lengths; chat: a long-tailed mix of lengths")
    p.add_argument("--duration", type=float, default=10.0, help="measurement window per level, seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window opens")
    p.add_argument("--ttft-target", type=float, default=2.0, help="goodput: time to first token at most this (s)")
    p.add_argument("--tpot-target", type=float, default=0.2,
                   help="goodput: mean time per output token at most this (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here (default: bench_results/runs/)")
    return p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from tritone_bench.results import save
    from tritone_bench.streams import GrpcStreams

    args = build_parser().parse_args(argv)
    if args.tokenizer is None:
        from tritone.checkpoints import prepare_default_model

        args.tokenizer = str(prepare_default_model())
    factory = PromptFactory(AutoTokenizer.from_pretrained(args.tokenizer), args.seed)
    num = 2 * max(args.concurrency + [64])
    workload = (Workload.chat(factory, num, args.seed) if args.mix == "chat"
                else Workload.fixed(factory, num, args.prompt_tokens, args.output_tokens))
    metrics = ServerMetrics(args.metrics_url) if args.metrics_url else None
    rows = []
    for concurrency in args.concurrency:
        stats = measure_level(GrpcStreams(args.url, args.model), workload, concurrency, duration=args.duration,
                              warmup=args.warmup, metrics=metrics, ttft_target=args.ttft_target,
                              tpot_target=args.tpot_target)
        rows.append((args.model, stats))
        print(table_row(args.model, stats) if len(rows) > 1 else markdown_table(rows), flush=True)
    print(f"results: {save('tritone-load', {'config': vars(args), 'levels': [s for _, s in rows]}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
