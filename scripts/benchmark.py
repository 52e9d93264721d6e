"""Engine benchmark: the full ensemble over gRPC streaming against Hugging Face `generate`.

Prompts of --prompt-len tokens, --output-len tokens each with end of sequence ignored, at each
concurrency, each level a time-boxed window of the load generator (tritone_client.load); then
static batches of `generate` as the baseline, in the same run. Prints output
tokens/s, time to first token and inter-token latency (mean, p99), and the engine's
forward-busy fraction (from the server's metrics). Run it with scripts/benchmark.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritone.config import resolve_dtype
from tritone.launcher import Server, build_parser
from tritone.models import resolve_model
from tritone_client.load import PromptFactory, ServerMetrics, Workload, measure_level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_baseline(model_dir, prompts_ids, batch, output_len, dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(prompts_ids[:batch])
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == output_len
    return {"output_tokens_per_s": batch * output_len / elapsed, "itl_mean": elapsed / output_len,
            "elapsed_s": elapsed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face model directory (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32, 128])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--duration", type=float, default=15.0, help="measurement window per level, seconds")
    p.add_argument("--server-args", default="", help="extra scripts/serve options, quoted")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    model_dir = resolve_model(args.model)
    factory = PromptFactory(AutoTokenizer.from_pretrained(model_dir))
    n_max = max(args.concurrency + args.hf_batches)
    workload = Workload.fixed(factory, max(n_max * 2, 8), args.prompt_len, args.output_len)
    prompts_ids = [factory.tokenizer(text).input_ids for text, _, _ in workload.prompts]
    results = {"config": vars(args), "tritone": {}, "hf_generate": {}}

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    for batch in args.hf_batches:
        print(f"Hugging Face generate, static batch {batch}...", flush=True)
        results["hf_generate"][batch] = hf_baseline(model_dir, prompts_ids, batch, args.output_len, dtype)

    ports = [str(free_port()) for _ in range(3)]
    server_args = build_parser().parse_args(["--dtype", args.dtype, "--http-port", ports[0], "--grpc-port", ports[1],
                                             "--metrics-port", ports[2], *args.server_args.split()]
                                            + (["--model", str(model_dir)] if args.model else []))
    server = Server(server_args)
    server.run_dir.mkdir(parents=True, exist_ok=True)
    log = open(server.run_dir / "server.log", "w")
    print(f"Starting tritonserver (log: {log.name})...", flush=True)
    server.start(stdout=log)
    try:
        server.wait_ready()
        url = f"{server_args.host}:{server_args.grpc_port}"
        metrics = ServerMetrics(f"http://{server_args.host}:{server_args.metrics_port}/metrics")
        measure_level(url, "ensemble", Workload.fixed(factory, 4, 16, 8), 1.0, 0.0, 4, progress=False)  # warm-up
        for c in args.concurrency:
            level = measure_level(url, "ensemble", workload, args.duration, 2.0, c, metrics=metrics)
            results["tritone"][c] = level
            print(f"concurrency {c}: {level['output_tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        server.stop()

    print_report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_report(results, args):
    print(f"\nprompt {args.prompt_len} tokens, output {args.output_len} tokens (end of sequence ignored)")
    print("| configuration | output tok/s | TTFT mean (s) | TTFT p99 (s) | ITL mean (ms) | ITL p99 (ms) | forward-busy |")
    print("|---|---|---|---|---|---|---|")
    for c, r in results["tritone"].items():
        t, i = r["ttft_s"], r["itl_s"]
        print(f"| Tritone, concurrency {c} | {r['output_tokens_per_s']:.1f} | {t['mean']:.3f} | {t['p99']:.3f} "
              f"| {1000 * i['mean']:.1f} | {1000 * i['p99']:.1f} | {r['forward_busy']:.2f} |")
    for b, r in results["hf_generate"].items():
        print(f"| HF generate, static batch {b} | {r['output_tokens_per_s']:.1f} | | | {1000 * r['itl_mean']:.1f} | | |")
    hf, tr = results["hf_generate"], results["tritone"]
    if 32 in hf:
        for c in (32, 128):
            if c in tr:
                print(f"concurrency {c} / HF batch 32: {tr[c]['output_tokens_per_s'] / hf[32]['output_tokens_per_s']:.2f}x")
    if 1 in hf and 1 in tr:
        print(f"ITL at concurrency 1: {1000 * tr[1]['itl_s']['mean']:.1f} ms vs HF batch 1 {1000 * hf[1]['itl_mean']:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
