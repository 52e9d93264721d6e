"""Engine benchmark: the full ensemble over gRPC streaming against Hugging Face `generate`.

Prompts of --prompt-len tokens, --output-len tokens each with end of sequence ignored, at each
concurrency; then static batches of `generate` as the baseline, in the same run. Prints output
tokens/s, time to first token and inter-token latency (mean, p99), and the engine's
forward-busy fraction (from the server's metrics). Run it with scripts/benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request

import numpy as np
import torch
import tritonclient.grpc.aio as grpcaio
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritone.executor.hardware import resolve_dtype
from tritone.launcher import Server, build_parser, free_port
from tritone.models import resolve_model
from tritone_client import infer_inputs


def make_prompts(tokenizer, num: int, length: int, seed: int = 0) -> list[str]:
    """Texts of exactly `length` tokens, from single-token words, seeded."""
    rng = random.Random(seed)
    words = [w for w in ("the of and to in is that it for was on are as with his they at be this from have or by "
                         "one had not but what all were when we there can an your which their said if do will each "
                         "about how up out them then she many some so these would other into has more her two like "
                         "him see time could no make than first been its who now people my made over did down only "
                         "way find use may water long little very after words called just where most know").split()]
    single = [w for w in words if len(tokenizer(" " + w, add_special_tokens=False).input_ids) == 1]
    prompts = []
    for _ in range(num):
        text = " ".join(rng.choice(single) for _ in range(length))
        ids = tokenizer(text, add_special_tokens=False).input_ids[:length]
        prompts.append(tokenizer.decode(ids))
    return prompts


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


async def run_level(url, prompts, concurrency, output_len):
    client = grpcaio.InferenceServerClient(url)
    ttfts, itls, counts = [], [], []
    queue = list(prompts)
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", leave=False)

    async def one(prompt):
        inputs = infer_inputs(grpcaio, (("text_input", np.array([[prompt.encode()]], dtype=object)),
                                        ("max_tokens", np.array([[output_len]], dtype=np.int32)),
                                        ("end_id", np.array([[-1]], dtype=np.int32)),
                                        ("stream", np.array([[True]])),
                                        ("apply_chat_template", np.array([[False]]))))

        async def requests():
            yield {"model_name": "ensemble", "inputs": inputs}

        start = last = time.perf_counter()
        first = None
        n = 0
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error)
            now = time.perf_counter()
            n = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
            if first is None:
                first = now
                ttfts.append(now - start)
            else:
                itls.append(now - last)
            last = now
        counts.append(n)
        bar.update(1)

    async def worker():
        while queue:
            await one(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    bar.close()
    await client.close()
    return {"output_tokens_per_s": sum(counts) / elapsed, "ttft_mean": statistics.mean(ttfts),
            "ttft_p99": percentile(ttfts, 99), "itl_mean": statistics.mean(itls) if itls else float("nan"),
            "itl_p99": percentile(itls, 99), "elapsed_s": elapsed, "num_requests": len(counts)}


def forward_seconds(metrics_url) -> float:
    with urllib.request.urlopen(metrics_url) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tritone_forward_seconds_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


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
    p.add_argument("--requests-per-level", type=int, default=0, help="0: max(4, 2 x concurrency), at most 256")
    p.add_argument("--server-args", default="", help="extra scripts/serve options, quoted")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_max = max(args.concurrency + args.hf_batches)
    prompts = make_prompts(tokenizer, max(n_max * 2, 8), args.prompt_len)
    prompts_ids = [tokenizer(t, add_special_tokens=False).input_ids for t in prompts]
    assert all(len(i) == args.prompt_len for i in prompts_ids), "prompt length drifted on re-tokenization"
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
        metrics_url = f"http://{server_args.host}:{server_args.metrics_port}/metrics"
        asyncio.run(run_level(url, prompts[:4], 4, 8))  # warm-up
        for c in args.concurrency:
            n = args.requests_per_level or min(256, max(4, 2 * c))
            f0, t0 = forward_seconds(metrics_url), time.perf_counter()
            level = asyncio.run(run_level(url, (prompts * 4)[:n], c, args.output_len))
            time.sleep(1.2)  # the server reports metrics once a second
            level["forward_busy"] = (forward_seconds(metrics_url) - f0) / (time.perf_counter() - t0 - 1.2)
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
        print(f"| Tritone, concurrency {c} | {r['output_tokens_per_s']:.1f} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} "
              f"| {1000 * r['itl_mean']:.1f} | {1000 * r['itl_p99']:.1f} | {r['forward_busy']:.2f} |")
    for b, r in results["hf_generate"].items():
        print(f"| HF generate, static batch {b} | {r['output_tokens_per_s']:.1f} | | | {1000 * r['itl_mean']:.1f} | | |")
    hf, tr = results["hf_generate"], results["tritone"]
    if 32 in hf:
        for c in (32, 128):
            if c in tr:
                print(f"concurrency {c} / HF batch 32: {tr[c]['output_tokens_per_s'] / hf[32]['output_tokens_per_s']:.2f}x")
    if 1 in hf and 1 in tr:
        print(f"ITL at concurrency 1: {1000 * tr[1]['itl_mean']:.1f} ms vs HF batch 1 {1000 * hf[1]['itl_mean']:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
