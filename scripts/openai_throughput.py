"""Streaming throughput through tritone-openai against the same load sent straight to the
`ensemble` over gRPC, in one run on one server: is the front end ever the bottleneck?

For each concurrency, a closed loop of streamed requests (prompts of exact token lengths, no
chat template, end of sequence ignored, the same for both paths) runs first over gRPC with
tritone_client.load's machinery, then through the front end's /v1/completions (SSE, token
counts from vLLM's stream_options.continuous_usage_stats), with the same measurement window.
A measurement, not a test: figures on shared machines move by 10% between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


async def run_openai_load(base_url: str, model: str, workload, duration: float, warmup: float,
                          concurrency: int, drain_timeout: float = 120.0):
    """tritone_client.load.run_load's closed loop, through the OpenAI API: the same Records."""
    import aiohttp

    from tritone_client.load import Record

    records: list[Record] = []
    order = iter(range(1 << 62))
    start = time.perf_counter()
    stop_at = start + warmup + duration

    async def one(session):
        text, prompt_tokens, max_tokens = workload.prompts[next(order) % len(workload.prompts)]
        record = Record(start=time.perf_counter(), max_tokens=max_tokens, prompt_tokens=prompt_tokens)
        records.append(record)
        body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with session.post(f"{base_url}/completions", json=body) as response:
            if response.status != 200:
                record.error, record.end = await response.text(), time.perf_counter()
                return
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk.get("usage"):  # the first chunk (the role) has none
                    record.chunks.append((time.perf_counter(), chunk["usage"]["completion_tokens"]))
        record.end = time.perf_counter()

    async def worker(session):
        while time.perf_counter() < stop_at:
            await one(session)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        work = asyncio.gather(*(worker(session) for _ in range(concurrency)))
        try:
            await asyncio.wait_for(work, timeout=warmup + duration + drain_timeout)
        except asyncio.TimeoutError:
            pass
    return records, (start + warmup, stop_at)


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
    p.add_argument("--json", type=pathlib.Path, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    from tritone.launcher import free_port, temporary_server
    from tritone.models import resolve_model
    from tritone_client.load import PromptFactory, ServerMetrics, Workload, level_stats, run_load

    model_dir = resolve_model(args.model)
    workload = Workload.fixed(PromptFactory(AutoTokenizer.from_pretrained(model_dir)), 256, args.prompt_tokens,
                              args.output_tokens)
    options = ["--openai-port", str(free_port()), "--no-prefix-caching"] + (["--model", args.model] if args.model else [])
    results = []
    with temporary_server(pathlib.Path("/tmp/tritone-openai-throughput.log"), *options) as server:
        grpc_url = f"{server.args.host}:{server.args.grpc_port}"
        metrics = ServerMetrics(f"http://{server.args.host}:{server.args.metrics_port}/metrics")
        for concurrency in args.concurrency:
            row = {"concurrency": concurrency}
            for path in ("grpc", "openai"):
                metrics.wait_idle()
                if path == "grpc":
                    records, window = asyncio.run(run_load(grpc_url, "ensemble", workload, args.duration,
                                                           args.warmup, concurrency, progress=False))
                else:
                    records, window = asyncio.run(run_openai_load(server.openai_url, model_dir.name, workload,
                                                                  args.duration, args.warmup, concurrency))
                row[path] = level_stats(records, window)
                s = row[path]
                print(f"c={concurrency:4d} {path:7s} {s['output_tokens_per_s']:8.1f} output tok/s  "
                      f"TTFT p50 {s['ttft_s']['p50']:.3f} s  ITL p50 {1000 * s['itl_s']['p50']:.1f} ms  "
                      f"errors {s['num_errors']}", flush=True)
            row["ratio"] = row["openai"]["output_tokens_per_s"] / max(1e-9, row["grpc"]["output_tokens_per_s"])
            print(f"c={concurrency:4d} front end / gRPC: {row['ratio']:.3f}", flush=True)
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
