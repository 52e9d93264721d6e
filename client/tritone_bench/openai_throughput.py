"""Streaming throughput through tritone-openai against the same load sent straight to the
`ensemble` over gRPC, in one run on one server: is the front end ever the bottleneck?

For each concurrency, the closed loop of `tritone_bench.load` (prompts of exact token lengths, no
chat template, end of sequence ignored, the same for both paths) runs over gRPC and through the
front end's /v1/completions (SSE, token counts from stream_options.continuous_usage_stats) in
alternating windows, several rounds, the order swapped each round: a shared 2-core machine's speed
drifts by 10-20% from one minute to the next, more than the difference being measured, and
alternation spreads the drift over both paths. The CPU each process of the server and the front
end spends per output token is reported beside tok/s. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/openai_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0,
                   help="measurement window per level and path, seconds: longer than a request takes, so that "
                        "requests start and finish inside it")
    p.add_argument("--rounds", type=int, default=3,
                   help="windows per path and level, alternating between the paths (default 3)")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--json", help="write the results here (default: a new file under bench_results/runs/)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    from tritone.checkpoints import resolve_model
    from tritone.launcher import temporary_server
    from tritone.processes import free_port
    from tritone_bench.load import measure_level
    from tritone_bench.metrics import ServerMetrics
    from tritone_bench.proc_cpu import ProcessTree, format_per_token
    from tritone_bench.results import RUNS, save
    from tritone_bench.streams import GrpcStreams, OpenAIStreams
    from tritone_bench.workload import PromptFactory, Workload

    model_dir = resolve_model(args.model)
    workload = Workload.fixed(PromptFactory(AutoTokenizer.from_pretrained(model_dir)), 256, args.prompt_tokens,
                              args.output_tokens)
    options = ["--openai-port", str(free_port()), "--no-prefix-caching"] + (["--model", args.model] if args.model else [])
    rows = []
    RUNS.mkdir(parents=True, exist_ok=True)
    with temporary_server(RUNS / "openai-throughput-server.log", *options) as server:
        senders = {"grpc": GrpcStreams(f"{server.args.host}:{server.args.grpc_port}"),
                   "openai": OpenAIStreams(server.openai_url, model_dir.name)}
        tree = ProcessTree(server.process.pid, server.frontend.pid)
        for concurrency in args.concurrency:
            windows = {path: [] for path in senders}
            for round_ in range(args.rounds):
                for path in (list(senders) if round_ % 2 == 0 else list(senders)[::-1]):
                    s = measure_level(senders[path], workload, concurrency, duration=args.duration,
                                      warmup=args.warmup, metrics=ServerMetrics.of(server), tree=tree,
                                      progress=False)
                    windows[path].append(s)
                    print(f"c={concurrency:4d} round {round_ + 1} {path:7s} {s['output_tokens_per_s']:8.1f} output tok/s"
                          f"  TTFT p50 {s['ttft_s']['p50']:.3f} s  ITL p50 {1000 * s['itl_s']['p50']:.1f} ms"
                          f"  errors {s['num_errors']}\n    CPU ms per token: {format_per_token(s['cpu_ms_per_token'])}",
                          flush=True)
            row = {"concurrency": concurrency, "rounds": windows}
            row.update({path: pooled(found) for path, found in windows.items()})
            row["ratio"] = row["openai"]["output_tokens_per_s"] / max(1e-9, row["grpc"]["output_tokens_per_s"])
            row["round_ratios"] = [o["output_tokens_per_s"] / max(1e-9, g["output_tokens_per_s"])
                                   for g, o in zip(windows["grpc"], windows["openai"])]
            print(f"c={concurrency:4d} front end / gRPC: {row['ratio']:.3f} (rounds: "
                  f"{', '.join(f'{r:.3f}' for r in row['round_ratios'])}); front end CPU "
                  f"{row['openai']['cpu_ms_per_token'].get('openai front end', 0.0):.3f} ms per token", flush=True)
            rows.append(row)
    print(f"results: {save('openai-throughput', {'config': vars(args), 'levels': rows}, args.json)}")
    return 0


def pooled(windows: list[dict]) -> dict:
    """One path's windows as one: tokens over time, the median of each latency percentile, the mean
    CPU per token of each role."""
    seconds = sum(w["window_s"] for w in windows)
    stats = {"output_tokens_per_s": sum(w["num_output_tokens"] for w in windows) / max(1e-9, seconds),
             "num_output_tokens": sum(w["num_output_tokens"] for w in windows),
             "num_errors": sum(w["num_errors"] for w in windows)}
    for key in ("ttft_s", "itl_s"):
        stats[key] = {p: statistics.median([w[key][p] for w in windows]) for p in windows[0][key]}
    roles = {role for w in windows for role in w.get("cpu_ms_per_token", {})}
    stats["cpu_ms_per_token"] = {role: sum(w.get("cpu_ms_per_token", {}).get(role, 0.0) for w in windows) / len(windows)
                                 for role in roles}
    return stats


if __name__ == "__main__":
    sys.exit(main())
