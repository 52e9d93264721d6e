"""The benchmark suite: what the three-process split buys, against the same engine doing its own
text work, and against Hugging Face `generate` (static batching).

For a tiny random model (a step of a few milliseconds, as the default model's on a GPU, where
text work weighs most) and the default model, it starts a server with the `ensemble` stack, then
one with the single-process `llm_inline`, and runs the closed loop of `tritone_bench.load` with a
measurement window over the same concurrency levels with short (64-token) and long (2,000-token)
prompts and a long-tailed chat mix, reading the engine's forward-busy fraction for each level;
perf_analyzer runs once against the ensemble. It writes its result file (machine, commit, date)
and a plot beside it; `scripts/render_docs` renders the file's tables. Run it with scripts/bench_suite.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from tritone_bench.results import RUNS, save

# Per model: prompt kinds (prompt tokens, max_tokens, {closed-loop concurrency: measurement
# window in seconds}), the window and concurrency of the chat mix, the warm-up per level (s), and
# HF generate's static batches. A closed loop starts requests only as others finish, so a level's
# window must outlast a request's end-to-end time, or it sees neither first tokens nor finishes.
SUITE = {
    "tiny": {"kinds": {"short": (64, 32, {1: 6, 4: 6, 16: 6, 64: 10, 256: 20}),
                       "long": (2000, 16, {1: 6, 4: 6, 16: 6, 64: 8})},
             "chat": {16: 6.0}, "warmup": 1.0, "hf_batches": [1, 16, 64, 256]},
    "default": {"kinds": {"short": (64, 32, {1: 20, 16: 20, 64: 20}), "long": (2000, 8, {1: 30, 2: 30})},
                "chat": {}, "warmup": 3.0, "hf_batches": [1, 16, 64]},
}
QUICK = {
    "tiny": {"kinds": {"short": (64, 16, {1: 2, 16: 2}), "long": (500, 4, {4: 2})}, "chat": {4: 2.0},
             "warmup": 0.5, "hf_batches": [4]},
}
STACKS = ("ensemble", "llm_inline")


def run_model(name: str, plan: dict, out_dir: pathlib.Path, perf_analyzer: bool) -> dict:
    from transformers import AutoTokenizer

    from tritone.checkpoints import prepare_default_model, prepare_tiny_model
    from tritone.launcher import temporary_server
    from tritone_bench.load import measure_level
    from tritone_bench.metrics import ServerMetrics, format_breakdown
    from tritone_bench.stats import tokens_per_s
    from tritone_bench.streams import GrpcStreams
    from tritone_bench.workload import PromptFactory, Workload

    model_dir = prepare_tiny_model() if name == "tiny" else prepare_default_model()
    factory = PromptFactory(AutoTokenizer.from_pretrained(model_dir), seed=0)
    workloads = {kind: Workload.fixed(factory, max(8, 2 * max(levels)), prompt, output)
                 for kind, (prompt, output, levels) in plan["kinds"].items()}
    levels = [(kind, c, window) for kind, (_, _, cs) in plan["kinds"].items() for c, window in cs.items()]
    if plan["chat"]:
        workloads["chat"] = Workload.chat(factory, 256, seed=0, max_prompt=2000, max_output=128)
        levels += [("chat", c, window) for c, window in plan["chat"].items()]
    rows, pa = [], None
    for stack in STACKS:
        print(f"== {name} model, {stack}", flush=True)
        # No prefix caching: the workload cycles through a pool of prompts, and a cache hit would
        # turn a long prompt into a short one.
        options = ["--model", str(model_dir), "--kv-cache-bytes", str(1 << 30), "--no-prefix-caching"]
        with temporary_server(out_dir / f"server_{name}_{stack}.log",
                              *options, "--pipeline", "inline" if stack == "llm_inline" else "ensemble") as server:
            url = f"{server.args.host}:{server.args.grpc_port}"
            measure_level(GrpcStreams(url, "ensemble"), Workload.fixed(factory, 4, 16, 4), 4, num_requests=8,
                          progress=False)  # first-call costs out of the way
            for kind, c, window in levels:
                stats = measure_level(GrpcStreams(url, "ensemble"), workloads[kind], c, duration=window,
                                      warmup=plan["warmup"], metrics=ServerMetrics.of(server),
                                      ttft_target=2.0, tpot_target=0.2)
                rows.append({"model": name, "prompts": kind, "stack": stack, **stats})
                print(f"{name} {kind} {stack} c={c}: {tokens_per_s(stats['output_tokens_per_s'])} tok/s, ITL p99 "
                      f"{1000 * stats['itl_s']['p99']:.1f} ms, forward-busy {stats['forward_busy']:.2f}; "
                      f"{format_breakdown(stats['step_ms'])}", flush=True)
            if perf_analyzer and stack == "ensemble" and name == "tiny":
                pa = run_perf_analyzer(url, factory, out_dir)
    prompt, output, _ = plan["kinds"]["short"]
    hf = run_hf(model_dir, factory, prompt, output, plan["hf_batches"])
    return {"rows": rows, "hf_generate": hf, "perf_analyzer": pa,
            "short": plan["kinds"]["short"][:2], "long": plan["kinds"]["long"][:2]}


def run_perf_analyzer(url: str, factory, out_dir: pathlib.Path) -> dict | None:
    from tritone_bench import perf_analyzer

    print("== perf_analyzer --streaming against ensemble (tiny model, concurrency 16)", flush=True)
    try:
        prompts = [factory.make(64) for _ in range(64)]
        return perf_analyzer.profile(url, prompts, 32, 16, 4000, out_dir / "perf_analyzer")
    except Exception as exc:  # the suite's other results stand without it
        print(f"perf_analyzer failed: {exc}", flush=True)
        return {"error": str(exc)}


def run_hf(model_dir, factory, prompt_tokens: int, output_tokens: int, batches: list[int]) -> list[dict]:
    import torch

    from tritone.executor.hardware import resolve_dtype
    from tritone_bench.benchmark import hf_baseline

    dtype = resolve_dtype("auto", torch.device("cpu"))
    ids = [factory.tokenizer(factory.make(prompt_tokens)).input_ids for _ in range(max(batches))]
    results = []
    for batch in batches:
        print(f"== Hugging Face generate, static batch {batch}", flush=True)
        results.append({"batch": batch, **hf_baseline(model_dir, ids, batch, output_tokens, dtype)})
    return results


def ratios(rows: list[dict]) -> list[dict]:
    """Three-stage over single-process, level by level."""
    by_key = {(r["model"], r["prompts"], r["concurrency"], r["stack"]): r for r in rows}
    out = []
    for (model, prompts, c, stack), ens in by_key.items():
        inline = by_key.get((model, prompts, c, "llm_inline"))
        if stack != "ensemble" or inline is None:
            continue
        out.append({"model": model, "prompts": prompts, "load": c,
                    "throughput_ratio": ens["output_tokens_per_s"] / max(inline["output_tokens_per_s"], 1e-9),
                    "itl_p99_ratio": ens["itl_s"]["p99"] / max(inline["itl_s"]["p99"], 1e-9),
                    "busy_ensemble": ens["forward_busy"], "busy_inline": inline["forward_busy"]})
    return out


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, kind) for name, r in results["models"].items() for kind in ("short", "long")]
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 6.5), squeeze=False)
    for col, (name, kind) in enumerate(panels):
        rows = [r for r in results["models"][name]["rows"] if r["prompts"] == kind]
        for stack, style in zip(STACKS, ("o-", "s--")):
            points = sorted((r["concurrency"], r) for r in rows if r["stack"] == stack)
            xs = [c for c, _ in points]
            axes[0][col].plot(xs, [r["output_tokens_per_s"] for _, r in points], style, label=stack)
            axes[1][col].plot(xs, [1000 * r["itl_s"]["p99"] for _, r in points], style, label=stack)
        axes[0][col].set_title(f"{name} model, {kind} prompts")
        for row, ylabel in ((0, "output tokens/s"), (1, "p99 inter-token latency (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from tritone_bench import report

    p = argparse.ArgumentParser(prog="scripts/bench_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["tiny", "default"], default=["tiny", "default"])
    p.add_argument("--quick", action="store_true", help="a few short levels on the tiny model, to check the set-up")
    p.add_argument("--no-perf-analyzer", action="store_true")
    p.add_argument("--json", help="write the results here (default: a new file under bench_results/runs/); "
                                  "the plot goes beside it")
    args = p.parse_args(argv)
    RUNS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    plans = QUICK if args.quick else {name: SUITE[name] for name in args.models}
    results = {"config": vars(args), "models": {}}
    for name, plan in plans.items():
        results["models"][name] = run_model(name, plan, RUNS, not args.no_perf_analyzer)
    results["ratios"] = [x for r in results["models"].values() for x in ratios(r["rows"])]
    results["perf_analyzer"] = next((r["perf_analyzer"] for r in results["models"].values() if r["perf_analyzer"]),
                                    None)
    results["wall_s"] = time.perf_counter() - start
    path = save("bench-suite", results, args.json)
    plot(results, path.with_suffix(".png"))
    print("\n" + report.render("bench-suite", results))
    print(f"results: {path} and its plot {path.with_suffix('.png')} ({results['wall_s'] / 60:.1f} minutes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
