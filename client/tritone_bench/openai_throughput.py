"""Streaming throughput through tritone-openai against the same load sent straight to the
`ensemble` over gRPC, in one run on one server: is the front end ever the bottleneck?

For each concurrency, the closed loop of `tritone_bench.load` (prompts of exact token lengths, no
chat template, end of sequence ignored, the same for both paths) runs first over gRPC, then
through the front end's /v1/completions (SSE, token counts from stream_options.continuous_usage_stats),
with the same measurement window. A measurement, not a test: figures on shared machines move by
10% between runs.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/openai_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0,
                   help="measurement window per level and path, seconds: longer than a request takes, so that "
                        "requests start and finish inside it")
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
        for concurrency in args.concurrency:
            row = {"concurrency": concurrency}
            for path, sender in senders.items():
                row[path] = s = measure_level(sender, workload, concurrency, duration=args.duration,
                                              warmup=args.warmup, metrics=ServerMetrics.of(server), progress=False)
                print(f"c={concurrency:4d} {path:7s} {s['output_tokens_per_s']:8.1f} output tok/s  "
                      f"TTFT p50 {s['ttft_s']['p50']:.3f} s  ITL p50 {1000 * s['itl_s']['p50']:.1f} ms  "
                      f"errors {s['num_errors']}", flush=True)
            row["ratio"] = row["openai"]["output_tokens_per_s"] / max(1e-9, row["grpc"]["output_tokens_per_s"])
            print(f"c={concurrency:4d} front end / gRPC: {row['ratio']:.3f}", flush=True)
            rows.append(row)
    print(f"results: {save('openai-throughput', {'config': vars(args), 'levels': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
