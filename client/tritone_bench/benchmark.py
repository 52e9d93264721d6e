"""Engine benchmark: the full ensemble over gRPC streaming, against vLLM's CPU build and Hugging Face `generate`.

Prompts of --prompt-len tokens, --output-len tokens each with end of sequence ignored, at each
concurrency (the closed loop of `tritone_bench.load`, over a fixed number of requests, all
measured); with --peer vllm, then the same workload against vLLM's CPU build serving the same
model over its OpenAI /v1/completions stream, after Tritone's server has stopped (never both at
once), or with --interleave both up at once and the two stacks taking turns level by level; then
static batches of `generate` as the baseline, in the same run. Reports output
tokens/s, TTFT and ITL (`tritone_bench.stats`), the engine's forward-busy fraction and step
phases (from Tritone's metrics), the CPU per output token of each process of each stack, and
Tritone/vLLM ratios; writes them with the machine, commit and date as JSON.

With --structured json-schema, each level runs twice on each stack, without and with every request
constrained to the same JSON schema (an object whose array of words is longer than the output, so
that constrained requests also make --output-len tokens and pay the grammar at every step), and
the first-token latency of a schema never seen before is measured against a cached one.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, NamedTuple

from tritone_bench import peer, report
from tritone_bench.load import measure_level
from tritone_bench.metrics import ServerMetrics, format_breakdown
from tritone_bench.proc_cpu import ProcessTree, format_per_token
from tritone_bench.results import RUNS, save
from tritone_bench.streams import GrpcStreams, OpenAIStreams
from tritone_bench.workload import PromptFactory, Workload

# More words than any output here holds: a constrained request is cut by max_tokens, as a free one.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "words": {"type": "array", "items": {"type": "string"}, "minItems": 200}}, "required": ["title", "words"]}


def schema_variant(n: int) -> dict:
    """A schema no server has seen: the benchmark's with one property renamed."""
    props = dict(STRUCTURED_SCHEMA["properties"])
    props[f"title_{n}"] = props.pop("title")
    return {**STRUCTURED_SCHEMA, "properties": props, "required": [f"title_{n}", "words"]}


def hf_baseline(model_dir, prompts_ids, batch, output_len, dtype, temperature=0.0, top_p=1.0) -> dict:
    """Hugging Face `generate` on a static batch: output tokens/s and the time of a step."""
    import torch
    from transformers import AutoModelForCausalLM

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
    p.add_argument("--requests-per-level", "--num-requests", type=int, default=0,
                   help="requests per level (default 0: max(4, 2 x concurrency), at most 256)")
    p.add_argument("--server-args", default="", help="extra scripts/serve options, quoted")
    p.add_argument("--peer", choices=["vllm"],
                   help="also run vLLM's CPU build on the same workload, after Tritone (installed once "
                        "in .venv-vllm/; its server log goes to bench_results/runs/vllm-serve.log)")
    p.add_argument("--peer-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the peer's dtype; auto (default): whichever runs GEMMs faster in the peer's torch on "
                        "its engine threads, measured just before it starts (bf16 is several times slower "
                        "than fp32 without AVX512-BF16 or AMX, e.g. on an AVX2-only Zen 2)")
    p.add_argument("--peer-threads", type=int, default=0,
                   help="the peer engine's OpenMP threads (default 0: as many as Tritone's engine gets, "
                        "every core by default)")
    p.add_argument("--peer-args", default="", help="extra `vllm serve` options, quoted")
    p.add_argument("--vllm-bench", action="store_true",
                   help="with --peer vllm: also drive each stack through its OpenAI API with vLLM's own client, "
                        "`vllm bench serve` (random prompts of --prompt-len, --output-len tokens, end of sequence "
                        "ignored, 2 x concurrency prompts a level, 8 at concurrency 1)")
    p.add_argument("--interleave", action="store_true",
                   help="with --peer vllm: both servers up at once, the stacks taking turns at each level (Tritone "
                        "first at the first level, vLLM first at the next, ...), each stack's CPU while the other "
                        "ran reported, so that a ratio compares two runs minutes apart rather than a quarter of an "
                        "hour (this machine's speed moves by a tenth between runs)")
    p.add_argument("--structured", choices=["json-schema"],
                   help="also run each level with every request constrained to a JSON schema, and time the "
                        "first token of a new schema against a cached one")
    p.add_argument("--lora-mix", type=int, default=0,
                   help="with --server-args '--lora-modules ...' naming N adapters: run each level again with the "
                        "requests taking adapters 1 to N in turn (lora_task_id), against the base model's run")
    p.add_argument("--json", help="write the results here (default: a new file under bench_results/runs/)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch
    from transformers import AutoTokenizer

    from tritone.checkpoints import resolve_model
    from tritone.executor.hardware import resolve_dtype

    args = parse_args(argv)
    if args.vllm_bench and not args.peer:
        raise SystemExit("error: --vllm-bench needs --peer vllm (vLLM's client comes with its install)")
    if args.interleave and (not args.peer or args.structured or args.lora_mix):
        raise SystemExit("error: --interleave needs --peer vllm, and takes neither --structured nor --lora-mix")
    model_dir = resolve_model(args.model)
    # The peer's environment first: a failing install should not come after a long Tritone run.
    peer_python = peer.install() if args.peer else None
    factory = PromptFactory(AutoTokenizer.from_pretrained(model_dir))
    workload = Workload.fixed(factory, max(2 * max(args.concurrency + args.hf_batches), 8), args.prompt_len,
                              args.output_len)
    args.peer_python = peer_python
    results = {"config": {k: v for k, v in vars(args).items() if k != "peer_python"}, "tritone": {}, "peer": {},
               "hf_generate": {}, "tritone_structured": {}, "peer_structured": {}, "tritone_vllm_bench": {},
               "peer_vllm_bench": {}, "tritone_lora": {}}

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    results["tritone_dtype"] = str(dtype).removeprefix("torch.")
    prompts_ids = [factory.tokenizer(text).input_ids for text, _, _ in workload.prompts]
    for batch in args.hf_batches:
        print(f"Hugging Face generate, static batch {batch}...", flush=True)
        results["hf_generate"][batch] = hf_baseline(model_dir, prompts_ids, batch, args.output_len, dtype,
                                                    args.temperature, args.top_p)
    if args.interleave:
        run_interleaved(args, peer_python, model_dir, workload, results)
    else:
        run_tritone(args, model_dir, workload, results)
        if args.peer:
            run_peer(args, peer_python, model_dir, workload, results)
    path = save("benchmark", results, args.json)
    print("\n" + report.render("benchmark", results), flush=True)
    if results["peer"]:
        print(report.headline_table(results))
    if results["peer_vllm_bench"]:
        print("\nWith vLLM's own client (vllm bench serve), both through their OpenAI API\n"
              + report.vllm_bench_table(results))
    if args.structured:
        print("\nEvery request constrained to one JSON schema, against the same run free\n"
              + report.structured_table(results))
    print(f"\nresults: {path}")
    return 0


def level_requests(args, concurrency: int) -> int:
    return args.requests_per_level or min(256, max(4, 2 * concurrency))


def run_levels(args, stack: str, make_sender, workload, results, key: str, metrics=None, tree=None) -> None:
    """Every level of one stack, free and (with --structured) constrained, into results[key]."""
    schemas = [("", None)] + ([("_structured", STRUCTURED_SCHEMA)] if args.structured else [])
    warm = Workload([(text, prompt_tokens, 8) for text, prompt_tokens, _ in workload.prompts[:4]])
    measure_level(make_sender(None), warm, 4, num_requests=4, progress=False)
    for c in args.concurrency:
        for suffix, schema in schemas:
            level = measure_level(make_sender(schema), workload, c, num_requests=level_requests(args, c),
                                  metrics=metrics if schema is None else None, tree=tree, label=f"{stack} ")
            if level["num_errors"]:
                raise RuntimeError(f"{stack} failed requests at concurrency {c}: {level['errors']}")
            results.setdefault(key + suffix, {})[c] = level
            print_level(stack, c, level, schema)
    if args.structured:
        results["schema_ttft" if key == "tritone" else "peer_schema_ttft"] = schema_ttft(make_sender, workload)


def print_level(stack: str, c: int, level: dict, schema) -> None:
    steps = f"{format_breakdown(level['step_ms'])}; " if "step_ms" in level else ""
    other = (f"; the other stack meanwhile {level['other_stack_cpu_cores']:.3f} cores"
             if "other_stack_cpu_cores" in level else "")
    print(f"{stack}{', JSON schema' if schema else ''}, concurrency {c}: "
          f"{level['output_tokens_per_s']:.1f} tok/s, {level['tokens_per_response']:.2f} tokens per "
          f"response; {steps}CPU ms per token: {format_per_token(level['cpu_ms_per_token'])}{other}", flush=True)


def schema_ttft(make_sender, workload, tries: int = 3) -> dict:
    """Mean time to first token, alone, of a schema never seen before and of the same one again."""
    new, cached = [], []
    for i in range(tries):
        schema = schema_variant(int(time.time() * 1000) + i)
        for times, (text, prompt_tokens, _) in ((new, workload[i]), (cached, workload[i + tries])):
            one = Workload([(text, prompt_tokens, 4)])
            times.append(measure_level(make_sender(schema), one, 1, num_requests=1, progress=False)["ttft_s"]["mean"])
    return {"new_schema_ttft_s": sum(new) / tries, "cached_schema_ttft_s": sum(cached) / tries}


def tritone_server(args, model_dir):
    """Tritone's server as the benchmark runs it (a context manager)."""
    from tritone.launcher import temporary_server

    from tritone.processes import free_port

    options = ["--dtype", args.dtype, *args.server_args.split()] + (["--model", str(model_dir)] if args.model else [])
    if args.vllm_bench:
        options += ["--openai-port", str(free_port())]
    RUNS.mkdir(parents=True, exist_ok=True)
    return temporary_server(RUNS / "tritone-server.log", *options)


def tritone_sender(args, server, adapters=None):
    url = f"{server.args.host}:{server.args.grpc_port}"
    model = "ensemble"  # llm_inline answers under this name too (--pipeline inline)
    return lambda schema: GrpcStreams(url, model, args.temperature, args.top_p, schema, adapters)


def run_tritone(args, model_dir, workload, results) -> None:
    with tritone_server(args, model_dir) as server:
        results["tritone_pipeline"] = server.pipeline
        run_levels(args, "Tritone", tritone_sender(args, server), workload, results, "tritone",
                   ServerMetrics.of(server), ProcessTree(server.process.pid))
        if args.lora_mix:
            adapters = list(range(1, args.lora_mix + 1))
            run_levels(args, f"Tritone, adapters {adapters} in turn", tritone_sender(args, server, adapters),
                       workload, results, "tritone_lora", ServerMetrics.of(server), ProcessTree(server.process.pid))
            for c in args.concurrency:
                base, mixed = results["tritone"][c], results["tritone_lora"][c]
                print(f"adapters mixed / base model, concurrency {c}: "
                      f"{mixed['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x", flush=True)
        if args.vllm_bench:
            run_vllm_bench(args, "tritone", server.openai_url.removesuffix("/v1"), server.model_dir.name, model_dir,
                           results)


def start_peer(args, python, model_dir, results) -> peer.VllmServer:
    """vLLM's server, started and ready (the caller stops it)."""
    num_threads = peer.engine_threads(args.peer_threads)
    dtype = args.peer_dtype
    if dtype == "auto":
        dtype, speeds = peer.pick_dtype(python, num_threads)
        results["peer_gemm_gflops"] = speeds
        print(f"Peer dtype {dtype}: GEMM GFLOP/s on {num_threads} thread(s) at " + "/".join(speeds["float32"])
              + " x 576 x 1536: " + ", ".join(f"{name} " + "/".join(f"{g:.1f}" for g in by_rows.values())
                                             for name, by_rows in speeds.items()), flush=True)
    results["peer_dtype"], results["peer_threads"] = dtype, num_threads
    from tritone.processes import free_port

    RUNS.mkdir(parents=True, exist_ok=True)
    log_path = RUNS / "vllm-serve.log"
    server = peer.VllmServer(python, model_dir, free_port(), dtype, num_threads, log_path, args.peer_args.split())
    print(f"Starting vllm serve, {dtype}, {num_threads} engine thread(s) (log: {log_path}; it compiles "
          "for a few minutes at every start)...", flush=True)
    server.start()
    try:
        results["peer_ready_s"] = server.wait_ready()
    except BaseException:
        server.stop()
        raise
    print(f"vLLM ready in {results['peer_ready_s']:.0f} s", flush=True)
    return server


def peer_sender(args, server: peer.VllmServer):
    def sender(schema):
        extra = {"structured_outputs": {"json": schema}} if schema is not None else None
        return OpenAIStreams(f"{server.url}/v1", server.model_name, args.temperature, args.top_p, extra)

    return sender


def run_peer(args, python, model_dir, workload, results) -> None:
    server = start_peer(args, python, model_dir, results)
    try:
        run_levels(args, "vLLM", peer_sender(args, server), workload, results, "peer",
                   tree=ProcessTree(server.process.pid))
        if args.vllm_bench:
            run_vllm_bench(args, "peer", server.url, server.model_name, model_dir, results)
    finally:
        server.stop()


class Stack(NamedTuple):
    name: str
    make_sender: Callable
    metrics: ServerMetrics | None
    tree: ProcessTree
    url: str  # its OpenAI API's base, for vllm bench serve
    model: str


def run_interleaved(args, python, model_dir, workload, results) -> None:
    """Both stacks up at once, taking turns level by level; each one's CPU while the other ran is
    kept, so that a reader can see the idle stack took nothing from the busy one."""
    with tritone_server(args, model_dir) as tritone:
        results["tritone_pipeline"] = tritone.pipeline
        vllm = start_peer(args, python, model_dir, results)
        try:
            stacks = {
                "tritone": Stack("Tritone", tritone_sender(args, tritone), ServerMetrics.of(tritone),
                                 ProcessTree(tritone.process.pid),
                                 tritone.openai_url.removesuffix("/v1") if args.vllm_bench else "",
                                 tritone.model_dir.name),
                "peer": Stack("vLLM", peer_sender(args, vllm), None, ProcessTree(vllm.process.pid), vllm.url,
                              vllm.model_name),
            }
            warm = Workload([(text, prompt_tokens, 8) for text, prompt_tokens, _ in workload.prompts[:4]])
            for stack in stacks.values():
                measure_level(stack.make_sender(None), warm, 4, num_requests=4, progress=False)
            for i, c in enumerate(args.concurrency):
                order = ["tritone", "peer"] if i % 2 == 0 else ["peer", "tritone"]
                for key in order:
                    stack, other = stacks[key], stacks["peer" if key == "tritone" else "tritone"]
                    other_before, t0 = sum(other.tree.cpu_seconds().values()), time.perf_counter()
                    level = measure_level(stack.make_sender(None), workload, c, num_requests=level_requests(args, c),
                                          metrics=stack.metrics, tree=stack.tree, label=f"{stack.name} ")
                    if level["num_errors"]:
                        raise RuntimeError(f"{stack.name} failed requests at concurrency {c}: {level['errors']}")
                    level["other_stack_cpu_cores"] = ((sum(other.tree.cpu_seconds().values()) - other_before)
                                                      / (time.perf_counter() - t0))
                    results[key][c] = level
                    print_level(stack.name, c, level, None)
                if args.vllm_bench:
                    for key in order:
                        run_vllm_bench(args, key, stacks[key].url, stacks[key].model, model_dir, results, levels=[c])
        finally:
            vllm.stop()


def run_vllm_bench(args, stack: str, base_url: str, model_name: str, model_dir, results, levels=None) -> None:
    """Every level (or `levels`) through `vllm bench serve`, into results[stack + "_vllm_bench"]."""
    for c in levels or args.concurrency:
        result = peer.bench_serve(args.peer_python, base_url, model_name, model_dir, c, args.prompt_len,
                                  args.output_len, 8 if c == 1 else 2 * c, RUNS, stack)
        results[f"{stack}_vllm_bench"][c] = {key: result.get(key) for key in (
            "completed", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "mean_itl_ms")}
        print(f"vllm bench serve against {stack}, concurrency {c}: {result.get('output_throughput', 0):.1f} tok/s, "
              f"mean TPOT {result.get('mean_tpot_ms', 0):.1f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
