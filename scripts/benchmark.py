"""Engine benchmark: the full ensemble over gRPC streaming, against vLLM's CPU build and Hugging Face `generate`.

Prompts of --prompt-len tokens, --output-len tokens each with end of sequence ignored, at each
concurrency (closed loop); with --peer vllm, then the same workload against vLLM's CPU build
serving the same model over its OpenAI /v1/completions stream, after Tritone's server has
stopped (never both at once); then static batches of `generate` as the baseline, in the same
run. Prints output tokens/s, time to first token and inter-token latency (mean, p99), the
engine's forward-busy fraction (from Tritone's metrics), and Tritone/vLLM ratios. Run it with
scripts/benchmark.

Both stacks are measured the same way: TTFT is the time to the first response that carries a
token; a later response that carries k tokens after a gap of g seconds counts as k inter-token
gaps of g/k (the servers' own counts say how many tokens each response carries: Tritone's
num_output_tokens, vLLM's continuous usage), so a server that bundles tokens under load is
measured per token like one that streams each.

With --structured json-schema, each level runs twice on each stack, without and with every request
constrained to the same JSON schema (an object whose array of words is longer than the output, so
that constrained requests also make --output-len tokens and pay the grammar at every step), and
the first-token latency of a schema never seen before is measured against a cached one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import aiohttp
import numpy as np
import torch
import tritonclient.grpc.aio as grpcaio
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritone.executor.hardware import resolve_dtype
from tritone.launcher import Server, build_parser, free_port
from tritone.models import resolve_model
from tritone_client import infer_inputs
from tritone_client.load import STEP_PHASES, ServerMetrics, format_breakdown, step_breakdown
from tritone_client.machine import machine
from tritone_client.proc_cpu import ProcessTree, format_per_token, per_token_ms

import peer_vllm
from render_docs import structured_table


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


def token_timings(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, list[float], int, int]:
    """TTFT, inter-token gaps, output tokens and responses that carried tokens, of one request,
    from each response's arrival time and its count of output tokens so far (see the module's
    docstring)."""
    arrivals = [(t, n) for (t, n), (_, before) in zip(arrivals, [(start, 0)] + arrivals) if n > before]
    if not arrivals:
        return float("nan"), [], 0, 0
    gaps = []
    for (t, n), (t_prev, n_prev) in zip(arrivals[1:], arrivals):
        gaps += [(t - t_prev) / (n - n_prev)] * (n - n_prev)
    return arrivals[0][0] - start, gaps, arrivals[-1][1], len(arrivals)


async def closed_loop(one, prompts, concurrency, label="") -> dict:
    """Runs every prompt through `one(prompt)` -> (start, [(arrival, output tokens so far)]),
    `concurrency` at a time, each worker sending its next request when its last one ends."""
    ttfts, itls, counts, responses = [], [], [], []
    queue = list(prompts)
    bar = tqdm(total=len(prompts), desc=f"{label}concurrency {concurrency}", leave=False)

    async def worker():
        while queue:
            ttft, gaps, n, num_responses = token_timings(*await one(queue.pop()))
            ttfts.append(ttft)
            itls.extend(gaps)
            counts.append(n)
            responses.append(num_responses)
            bar.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    bar.close()
    return {"output_tokens_per_s": sum(counts) / elapsed, "ttft_mean": statistics.mean(ttfts),
            "ttft_p99": percentile(ttfts, 99), "itl_mean": statistics.mean(itls) if itls else float("nan"),
            "itl_p99": percentile(itls, 99), "elapsed_s": elapsed, "num_requests": len(counts),
            "num_output_tokens": sum(counts),
            "tokens_per_response": sum(counts) / max(1, sum(responses))}


# More words than any output here holds: a constrained request is cut by max_tokens, as a free one.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "words": {"type": "array", "items": {"type": "string"}, "minItems": 200}}, "required": ["title", "words"]}


def schema_variant(n: int) -> dict:
    """A schema no server has seen: the benchmark's with one property renamed."""
    props = dict(STRUCTURED_SCHEMA["properties"])
    props[f"title_{n}"] = props.pop("title")
    return {**STRUCTURED_SCHEMA, "properties": props, "required": [f"title_{n}", "words"]}


async def run_level(url, prompts, concurrency, output_len, temperature=0.0, top_p=1.0, schema=None, model="ensemble"):
    """One level against Tritone's ensemble (or `model`: llm_inline, where the server was started
    with --inline) over gRPC streaming (every request constrained to `schema`, when given)."""
    client = grpcaio.InferenceServerClient(url)

    async def one(prompt):
        tensors = [("text_input", np.array([[prompt.encode()]], dtype=object)),
                   ("max_tokens", np.array([[output_len]], dtype=np.int32)),
                   ("end_id", np.array([[-1]], dtype=np.int32)),
                   ("temperature", np.array([[temperature]], dtype=np.float32)),
                   ("top_p", np.array([[top_p]], dtype=np.float32)),
                   ("stream", np.array([[True]])),
                   ("apply_chat_template", np.array([[False]]))]
        if schema is not None:
            tensors += [("guided_decoding_guide_type", np.array([[b"json_schema"]], dtype=object)),
                        ("guided_decoding_guide", np.array([[json.dumps(schema).encode()]], dtype=object))]
        inputs = infer_inputs(grpcaio, tensors)

        async def requests():
            yield {"model_name": model, "inputs": inputs}

        start, arrivals = time.perf_counter(), []
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error)
            arrivals.append((time.perf_counter(), int(result.as_numpy("num_output_tokens").reshape(-1)[0])))
        return start, arrivals

    try:
        return await closed_loop(one, prompts, concurrency)
    finally:
        await client.close()


async def run_peer_level(server, prompts, concurrency, output_len, prompt_len, temperature=0.0, top_p=1.0,
                         schema=None):
    """One level against the peer's /v1/completions stream."""
    # No connection limit but the level's own concurrency; a generous timeout, as a request at
    # high concurrency on two cores takes minutes.
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(prompt):
            start, arrivals, num_prompt_tokens = await peer_vllm.stream_completion(
                session, server.url, server.model_name, prompt, output_len, temperature, top_p,
                {"structured_outputs": {"json": schema}} if schema is not None else None)
            if num_prompt_tokens != prompt_len:
                raise RuntimeError(f"vLLM counted {num_prompt_tokens} prompt tokens, not {prompt_len}")
            return start, arrivals

        return await closed_loop(one, prompts, concurrency, label="vLLM ")


def hf_baseline(model_dir, prompts_ids, batch, output_len, dtype, temperature=0.0, top_p=1.0):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(prompts_ids[:batch])
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature else \
            dict(do_sample=False)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, **sampling)
        elapsed = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == output_len
    return {"output_tokens_per_s": batch * output_len / elapsed, "itl_mean": elapsed / output_len,
            "elapsed_s": elapsed}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="scripts/benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face model directory (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, end of sequence ignored (default 128)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128],
                   help="closed-loop concurrency levels, for Tritone and the peer (default 1 32 128)")
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32, 128],
                   help="static batches of Hugging Face generate (default 1 32 128; none: no baseline)")
    p.add_argument("--dtype", default="auto", help="Tritone's --dtype (default auto)")
    p.add_argument("--temperature", type=float, default=0.0, help="every stack's temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="every stack's top-p (default 1)")
    p.add_argument("--requests-per-level", type=int, default=0, help="0: max(4, 2 x concurrency), at most 256")
    p.add_argument("--server-args", default="", help="extra scripts/serve options, quoted")
    p.add_argument("--peer", choices=["vllm"],
                   help="also run vLLM's CPU build on the same workload, after Tritone (installed once "
                        "in .venv-vllm/; its server log goes to bench_results/vllm-serve.log)")
    p.add_argument("--peer-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the peer's dtype; auto (default): whichever runs GEMMs faster in the peer's torch on "
                        "its engine threads, measured just before it starts (bf16 is several times slower "
                        "than fp32 without AVX512-BF16 or AMX, e.g. on an AVX2-only Zen 2)")
    p.add_argument("--peer-threads", type=int, default=0,
                   help="the peer engine's OpenMP threads (default 0: as many as Tritone's engine gets, "
                        "every core by default)")
    p.add_argument("--peer-args", default="", help="extra `vllm serve` options, quoted")
    p.add_argument("--structured", choices=["json-schema"],
                   help="also run each level with every request constrained to a JSON schema, and time the "
                        "first token of a new schema against a cached one")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    # The peer's environment first: a failing install should not come after a long Tritone run.
    peer_python = peer_vllm.install() if args.peer else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_max = max(args.concurrency + args.hf_batches)
    prompts = make_prompts(tokenizer, max(n_max * 2, 8), args.prompt_len)
    prompts_ids = [tokenizer(t, add_special_tokens=False).input_ids for t in prompts]
    assert all(len(i) == args.prompt_len for i in prompts_ids), "prompt length drifted on re-tokenization"
    results = {"config": vars(args), "machine": machine(), "tritone": {}, "peer": {}, "hf_generate": {},
               "tritone_structured": {}, "peer_structured": {}}

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    results["tritone_dtype"] = str(dtype).removeprefix("torch.")
    for batch in args.hf_batches:
        print(f"Hugging Face generate, static batch {batch}...", flush=True)
        results["hf_generate"][batch] = hf_baseline(model_dir, prompts_ids, batch, args.output_len, dtype,
                                                    args.temperature, args.top_p)
    run_tritone(args, model_dir, prompts, results)
    if args.peer:
        run_peer(args, peer_python, model_dir, prompts, results)

    print_report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def level_requests(args, prompts, concurrency):
    n = args.requests_per_level or min(256, max(4, 2 * concurrency))
    return (prompts * 4)[:n]


def run_tritone(args, model_dir, prompts, results):
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
        model = "llm_inline" if server_args.inline else "ensemble"
        asyncio.run(run_level(url, prompts[:4], 4, 8, model=model))  # warm-up
        tree = ProcessTree(server.process.pid)
        for c in args.concurrency:
            metrics.wait_idle()
            before, t0, cpu = metrics.read(), time.perf_counter(), tree.cpu_seconds()
            level = asyncio.run(run_level(url, level_requests(args, prompts, c), c, args.output_len,
                                          args.temperature, args.top_p, model=model))
            seconds = time.perf_counter() - t0
            level["cpu_ms_per_token"] = per_token_ms(cpu, tree.cpu_seconds(), level["num_output_tokens"])
            metrics.wait_idle()
            after = metrics.read()
            level["forward_busy"] = (after["tritone_forward_seconds_total"]
                                     - before["tritone_forward_seconds_total"]) / seconds
            level["step_ms"] = step_breakdown(before, after)
            results["tritone"][c] = level
            print(level_line("Tritone", c, level, format_breakdown(level["step_ms"])), flush=True)
            if args.structured:
                metrics.wait_idle()
                cpu = tree.cpu_seconds()
                level = asyncio.run(run_level(url, level_requests(args, prompts, c), c, args.output_len,
                                              args.temperature, args.top_p, STRUCTURED_SCHEMA, model=model))
                level["cpu_ms_per_token"] = per_token_ms(cpu, tree.cpu_seconds(), level["num_output_tokens"])
                results["tritone_structured"][c] = level
                print(level_line("Tritone, JSON schema", c, level), flush=True)
        if args.structured:
            results["schema_ttft"] = asyncio.run(schema_ttft(
                lambda prompt, schema: run_level(url, [prompt], 1, 4, schema=schema), prompts))
            print(f"Tritone first token, new schema / cached: {results['schema_ttft']}", flush=True)
    finally:
        server.stop()


async def schema_ttft(run, prompts, tries: int = 3) -> dict:
    """Mean time to first token, alone, of a schema never seen before and of the same one again."""
    new, cached = [], []
    for i in range(tries):
        schema = schema_variant(int(time.time() * 1000) + i)
        new.append((await run(prompts[i], schema))["ttft_mean"])
        cached.append((await run(prompts[i + tries], schema))["ttft_mean"])
    return {"new_schema_ttft_s": statistics.mean(new), "cached_schema_ttft_s": statistics.mean(cached)}


def level_line(stack: str, concurrency: int, level: dict, steps: str = "") -> str:
    return (f"{stack}, concurrency {concurrency}: {level['output_tokens_per_s']:.1f} tok/s, "
            f"{level['tokens_per_response']:.2f} tokens per response; " + (f"{steps}; " if steps else "")
            + f"CPU ms per token: {format_per_token(level['cpu_ms_per_token'])}")


def run_peer(args, python, model_dir, prompts, results):
    num_threads = peer_vllm.engine_threads(args.peer_threads)
    dtype = args.peer_dtype
    if dtype == "auto":
        dtype, speeds = peer_vllm.pick_dtype(python, num_threads)
        results["peer_gemm_gflops"] = speeds
        print(f"Peer dtype {dtype}: GEMM GFLOP/s on {num_threads} thread(s) at " + "/".join(speeds["float32"])
              + " x 576 x 1536: " + ", ".join(f"{name} " + "/".join(f"{g:.1f}" for g in by_rows.values())
                                             for name, by_rows in speeds.items()), flush=True)
    results["peer_dtype"], results["peer_threads"] = dtype, num_threads
    log_path = peer_vllm.ROOT / "bench_results" / "vllm-serve.log"
    log_path.parent.mkdir(exist_ok=True)
    server = peer_vllm.VllmServer(python, model_dir, free_port(), dtype, num_threads, log_path,
                                  args.peer_args.split())
    print(f"Starting vllm serve, {dtype}, {num_threads} engine thread(s) (log: {log_path}; it compiles "
          "for a few minutes at every start)...", flush=True)
    server.start()
    try:
        results["peer_ready_s"] = server.wait_ready()
        print(f"vLLM ready in {results['peer_ready_s']:.0f} s", flush=True)
        asyncio.run(run_peer_level(server, prompts[:4], 4, 8, args.prompt_len))  # warm-up
        tree = ProcessTree(server.process.pid)
        for c in args.concurrency:
            cpu = tree.cpu_seconds()
            level = asyncio.run(run_peer_level(server, level_requests(args, prompts, c), c, args.output_len,
                                               args.prompt_len, args.temperature, args.top_p))
            level["cpu_ms_per_token"] = per_token_ms(cpu, tree.cpu_seconds(), level["num_output_tokens"])
            results["peer"][c] = level
            print(level_line("vLLM", c, level), flush=True)
            if args.structured:
                cpu = tree.cpu_seconds()
                level = asyncio.run(run_peer_level(server, level_requests(args, prompts, c), c, args.output_len,
                                                   args.prompt_len, args.temperature, args.top_p, STRUCTURED_SCHEMA))
                level["cpu_ms_per_token"] = per_token_ms(cpu, tree.cpu_seconds(), level["num_output_tokens"])
                results["peer_structured"][c] = level
                print(level_line("vLLM, JSON schema", c, level), flush=True)
        if args.structured:
            results["peer_schema_ttft"] = asyncio.run(schema_ttft(
                lambda prompt, schema: run_peer_level(server, [prompt], 1, 4, args.prompt_len, schema=schema), prompts))
            print(f"vLLM first token, new schema / cached: {results['peer_schema_ttft']}", flush=True)
    finally:
        server.stop()


def print_report(results, args):
    sampling = f"temperature {args.temperature}, top-p {args.top_p}" if args.temperature else "greedy"
    print(f"\nprompt {args.prompt_len} tokens, output {args.output_len} tokens (end of sequence ignored, {sampling}); "
          f"Tritone {results['tritone_dtype']}"
          + (f", vLLM {results['peer_dtype']} on {results['peer_threads']} engine thread(s)" if results["peer"] else ""))
    print("| configuration | output tok/s | TTFT mean (s) | TTFT p99 (s) | ITL mean (ms) | ITL p99 (ms) | forward-busy |")
    print("|---|---|---|---|---|---|---|")
    for name, key in (("Tritone", "tritone"), ("vLLM CPU", "peer")):
        for c, r in results[key].items():
            busy = f"{r['forward_busy']:.2f}" if "forward_busy" in r else ""
            print(f"| {name}, concurrency {c} | {r['output_tokens_per_s']:.1f} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} "
                  f"| {1000 * r['itl_mean']:.1f} | {1000 * r['itl_p99']:.1f} | {busy} |")
    for b, r in results["hf_generate"].items():
        print(f"| HF generate, static batch {b} | {r['output_tokens_per_s']:.1f} | | | {1000 * r['itl_mean']:.1f} | | |")
    print("\nTritone's engine steps, milliseconds per step by phase (send: the sender thread, beside the next step)")
    print("| concurrency | steps | " + " | ".join(STEP_PHASES) + " |")
    print("|---|---|" + "---|" * len(STEP_PHASES))
    for c, r in results["tritone"].items():
        if "step_ms" in r:
            print(f"| {c} | {r['step_ms']['steps']:.0f} | " + " | ".join(f"{r['step_ms'][p]:.2f}" for p in STEP_PHASES) + " |")
    tr, peer, hf = results["tritone"], results["peer"], results["hf_generate"]
    if peer:
        print("\n| concurrency | Tritone tok/s | vLLM tok/s | Tritone/vLLM tok/s | Tritone ITL (ms) | vLLM ITL (ms) | Tritone/vLLM ITL |")
        print("|---|---|---|---|---|---|---|")
        for c in tr:
            if c in peer:
                t, v = tr[c], peer[c]
                print(f"| {c} | {t['output_tokens_per_s']:.1f} | {v['output_tokens_per_s']:.1f} "
                      f"| {t['output_tokens_per_s'] / v['output_tokens_per_s']:.2f}x | {1000 * t['itl_mean']:.1f} "
                      f"| {1000 * v['itl_mean']:.1f} | {t['itl_mean'] / v['itl_mean']:.2f}x |")
        if 1 in tr and 1 in peer:
            print(f"ITL at concurrency 1: Tritone {1000 * tr[1]['itl_mean']:.1f} ms, vLLM {1000 * peer[1]['itl_mean']:.1f} ms")
        print("tokens per streamed response, Tritone/vLLM: " + ", ".join(
            f"c={c} {tr[c]['tokens_per_response']:.2f}/{peer[c]['tokens_per_response']:.2f}" for c in tr if c in peer))
    print_cpu_per_token(results)
    print_structured(results)
    if 32 in hf:
        for c in (32, 128):
            if c in tr:
                print(f"concurrency {c} / HF batch 32: {tr[c]['output_tokens_per_s'] / hf[32]['output_tokens_per_s']:.2f}x")
    if 1 in hf and 1 in tr:
        print(f"ITL at concurrency 1: {1000 * tr[1]['itl_mean']:.1f} ms vs HF batch 1 {1000 * hf[1]['itl_mean']:.1f} ms")


def print_structured(results):
    if results.get("tritone_structured") or results.get("peer_structured"):
        print("\nEvery request constrained to one JSON schema, against the same run free")
        print(structured_table(results))


def print_cpu_per_token(results):
    """Each stack's processes, CPU milliseconds per output token (their /proc times over the level)."""
    rows = [(name, c, r["cpu_ms_per_token"]) for name, key in (("Tritone", "tritone"), ("vLLM CPU", "peer"))
            for c, r in results[key].items() if "cpu_ms_per_token" in r]
    if not rows:
        return
    roles = sorted({role for *_, report in rows for role in report}, key=lambda role: (role == "text path", role))
    print("\nCPU milliseconds per output token, by process (text path: tritonserver + preprocessing + postprocessing; "
          "other: any process not named, such as a model worker that a peer starts)")
    print("| stack | concurrency | " + " | ".join(roles) + " |")
    print("|---|---|" + "---|" * len(roles))
    for name, c, report in rows:
        print(f"| {name} | {c} | " + " | ".join(f"{report[role]:.3f}" if role in report else "" for role in roles) + " |")


if __name__ == "__main__":
    sys.exit(main())
