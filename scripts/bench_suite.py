"""The benchmark suite: what the three-process split buys, against the same engine doing its own
text work, and against Hugging Face `generate` (static batching).

For a tiny random model (a step of a few milliseconds, as the default model's on a GPU, where
text work weighs most) and the default model, it starts a server with the `ensemble` stack, then
one with the single-process `llm_inline`, and runs the load generator over the same concurrency
levels with short (64-token) and long (2,000-token) prompts, reading the engine's forward-busy
fraction for each level; perf_analyzer runs once against the ensemble. It writes results.json,
results.md and ablation.png into --out-dir and refreshes its section of docs/performance.md.
Run it with scripts/bench_suite.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

from tritone_client.machine import machine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmark.py, perf_analyzer.py beside it

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_BEGIN, README_END = "<!-- bench-suite:begin -->", "<!-- bench-suite:end -->"
# The document whose section between those markers the suite rewrites.
RESULTS_DOC = ROOT / "docs" / "performance.md"


# Per model: prompt kinds (prompt tokens, max_tokens, {closed-loop concurrency: measurement
# window in seconds}), the Poisson chat-mix rates and their window, the warm-up per level (s), and
# HF generate's static batches. A closed loop starts requests only as others finish, so a level's
# window must outlast a request's end-to-end time, or it sees neither first tokens nor finishes.
SUITE = {
    "tiny": {"kinds": {"short": (64, 32, {1: 6, 4: 6, 16: 6, 64: 10, 256: 20}),
                       "long": (2000, 16, {1: 6, 4: 6, 16: 6, 64: 8})},
             "chat_rates": [20.0], "duration": 6.0, "warmup": 1.0, "hf_batches": [1, 16, 64, 256]},
    "default": {"kinds": {"short": (64, 32, {1: 20, 16: 20, 64: 20}), "long": (2000, 8, {1: 30, 2: 30})},
                "chat_rates": [], "duration": 20.0, "warmup": 3.0, "hf_batches": [1, 16, 64]},
}
QUICK = {
    "tiny": {"kinds": {"short": (64, 16, {1: 2, 16: 2}), "long": (500, 4, {4: 2})}, "chat_rates": [10.0],
             "duration": 2.0, "warmup": 0.5, "hf_batches": [4]},
}
STACKS = ("ensemble", "llm_inline")


def start_server(model_dir: pathlib.Path, inline: bool, log_path: pathlib.Path):
    from tritone.launcher import Server, build_parser, free_port

    # No prefix caching: the workload cycles through a pool of prompts, and a cache hit would
    # turn a long prompt into a short one.
    args = build_parser().parse_args(["--model", str(model_dir), "--http-port", str(free_port()),
                                      "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
                                      "--kv-cache-bytes", str(1 << 30), "--no-prefix-caching"]
                                     + (["--inline"] if inline else []))
    server = Server(args, run_dir=pathlib.Path(tempfile.mkdtemp(prefix="tritone-bench-")))
    server.start(stdout=open(log_path, "w"))
    server.wait_ready()
    return server


def run_model(name: str, plan: dict, out_dir: pathlib.Path, perf_analyzer: bool) -> dict:
    from transformers import AutoTokenizer

    from tritone.models import prepare_default_model, prepare_tiny_model
    from tritone_client.load import PromptFactory, ServerMetrics, Workload, format_breakdown, measure_level, tokens_per_s

    model_dir = prepare_tiny_model() if name == "tiny" else prepare_default_model()
    factory = PromptFactory(AutoTokenizer.from_pretrained(model_dir), seed=0)
    workloads = {kind: Workload.fixed(factory, max(8, 2 * max(levels)), prompt, output)
                 for kind, (prompt, output, levels) in plan["kinds"].items()}
    if plan["chat_rates"]:
        workloads["chat"] = Workload.chat(factory, 256, seed=0, max_prompt=2000, max_output=128)
    rows, pa = [], None
    for stack in STACKS:
        print(f"== {name} model, {stack}: starting tritonserver", flush=True)
        server = start_server(model_dir, stack == "llm_inline", out_dir / f"server_{name}_{stack}.log")
        try:
            url = f"{server.args.host}:{server.args.grpc_port}"
            metrics = ServerMetrics(f"http://{server.args.host}:{server.args.metrics_port}/metrics")
            warm = Workload.fixed(factory, 4, 16, 4)
            measure_level(url, stack, warm, 1.0, 0.0, 4, progress=False)  # first-call costs out of the way
            levels = [(kind, c, None, window) for kind, (_, _, cs) in plan["kinds"].items()
                      for c, window in cs.items()]
            levels += [("chat", 256, rate, plan["duration"]) for rate in plan["chat_rates"]]
            for kind, c, rate, window in levels:
                stats = measure_level(url, stack, workloads[kind], window, plan["warmup"], c, rate,
                                      metrics, ttft_target=2.0, tpot_target=0.2)
                rows.append({"model": name, "prompts": kind, "stack": stack, **stats})
                print(f"{name} {kind} {stack} " + (f"rate {rate}/s" if rate else f"c={c}") +
                      f": {tokens_per_s(stats['output_tokens_per_s'])} tok/s, ITL p99 {1000 * stats['itl_s']['p99']:.1f} ms, "
                      f"forward-busy {stats['forward_busy']:.2f}; {format_breakdown(stats['step_ms'])}", flush=True)
            if perf_analyzer and stack == "ensemble" and name == "tiny":
                pa = run_perf_analyzer(url, factory, out_dir)
        finally:
            server.stop()
    prompt, output, _ = plan["kinds"]["short"]
    hf = run_hf(model_dir, factory, prompt, output, plan["hf_batches"])
    return {"rows": rows, "hf_generate": hf, "perf_analyzer": pa,
            "short": plan["kinds"]["short"][:2], "long": plan["kinds"]["long"][:2]}


def run_perf_analyzer(url: str, factory, out_dir: pathlib.Path) -> dict | None:
    import perf_analyzer

    print("== perf_analyzer --streaming against ensemble (tiny model, concurrency 16)", flush=True)
    try:
        prompts = [factory.make(64) for _ in range(64)]
        return perf_analyzer.profile(url, prompts, 32, 16, 4000, out_dir / "perf_analyzer")
    except Exception as exc:  # the suite's other results stand without it
        print(f"perf_analyzer failed: {exc}", flush=True)
        return {"error": str(exc)}


def run_hf(model_dir, factory, prompt_tokens: int, output_tokens: int, batches: list[int]) -> list[dict]:
    import torch

    from benchmark import hf_baseline
    from tritone.executor.hardware import resolve_dtype

    dtype = resolve_dtype("auto", torch.device("cpu"))
    ids = [factory.tokenizer(factory.make(prompt_tokens)).input_ids for _ in range(max(batches))]
    results = []
    for batch in batches:
        print(f"== Hugging Face generate, static batch {batch}", flush=True)
        results.append({"batch": batch, **hf_baseline(model_dir, ids, batch, output_tokens, dtype)})
    return results


# ---------------------------------------------------------------- reports

def label(row: dict) -> str:
    return f"{row['model']}, {row['prompts']}, {row['stack']}"


def ratios(rows: list[dict]) -> list[dict]:
    """Three-stage over single-process, level by level."""
    by_key = {(r["model"], r["prompts"], r["concurrency"], r["rate"], r["stack"]): r for r in rows}
    out = []
    for (model, prompts, c, rate, stack), ens in by_key.items():
        inline = by_key.get((model, prompts, c, rate, "llm_inline"))
        if stack != "ensemble" or inline is None:
            continue
        out.append({"model": model, "prompts": prompts, "load": f"{rate}/s" if rate else c,
                    "throughput_ratio": ens["output_tokens_per_s"] / max(inline["output_tokens_per_s"], 1e-9),
                    "itl_p99_ratio": ens["itl_s"]["p99"] / max(inline["itl_s"]["p99"], 1e-9),
                    "busy_ensemble": ens["forward_busy"], "busy_inline": inline["forward_busy"],
                    "tok_s_ensemble": ens["output_tokens_per_s"], "tok_s_inline": inline["output_tokens_per_s"]})
    return out


def markdown(results: dict) -> str:
    from tritone_client.load import markdown_table

    lines = []
    for name, r in results["models"].items():
        (sp, so), (lp, lo) = r["short"], r["long"]
        lines.append(f"**{name} model** (short: {sp} prompt tokens, {so} output; long: {lp} prompt tokens, "
                     f"{lo} output; chat: long-tailed mix, Poisson arrivals)\n")
        lines.append(markdown_table([(label(row), row) for row in r["rows"]]) + "\n")
        if r["hf_generate"]:
            lines.append("| Hugging Face generate (short prompts) | static batch | output tok/s | step (ms) |\n"
                         "|---|---|---|---|")
            lines += [f"| {name} | {h['batch']} | {h['output_tokens_per_s']:.0f} | {1000 * h['itl_mean']:.1f} |"
                      for h in r["hf_generate"]]
            lines.append("")
    lines.append("Three-stage `ensemble` over single-process `llm_inline`, level by level:\n")
    lines.append("| model | prompts | concurrency | tok/s ratio | ITL p99 ratio | forward-busy ensemble / inline |\n"
                 "|---|---|---|---|---|---|")
    lines += [f"| {x['model']} | {x['prompts']} | {x['load']} | {x['throughput_ratio']:.2f} "
              f"| {x['itl_p99_ratio']:.2f} | {x['busy_ensemble']:.2f} / {x['busy_inline']:.2f} |"
              for x in results["ratios"]]
    pa = results.get("perf_analyzer")
    if pa and "error" not in pa:
        lines.append(f"\nperf_analyzer `--streaming` against `ensemble` (tiny model, concurrency "
                     f"{pa['concurrency']}, 64-token prompts, 32 output tokens): {pa['requests_per_s']:.1f} "
                     f"requests/s, {pa['output_tokens_per_s']:.0f} output tokens/s, TTFT mean "
                     f"{1000 * pa['ttft_mean_s']:.0f} ms, ITL mean {1000 * pa['itl_mean_s']:.1f} ms "
                     f"(p99 {1000 * pa['itl_p99_s']:.1f} ms).")
    return "\n".join(lines) + "\n"


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


def refresh_readme(readme: pathlib.Path, results: dict, out_dir: pathlib.Path) -> None:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise RuntimeError(f"{readme.name} has no {README_BEGIN} ... {README_END} section to refresh")
    m = results["machine"]
    # Relative to the document, so that the link works wherever the checkout lies.
    image = pathlib.Path(os.path.relpath((out_dir / "ablation.png").resolve(), readme.resolve().parent)).as_posix()
    body = (f"{README_BEGIN}\n`scripts/bench_suite` on {m['cores']} cores ({m['cpu']}), one run, "
            f"{results['wall_s'] / 60:.1f} minutes in all:\n\n{markdown(results)}\n![ablation]({image})\n{README_END}")
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + body + text[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["tiny", "default"], default=["tiny", "default"])
    p.add_argument("--quick", action="store_true", help="a few short levels on the tiny model, to check the set-up")
    p.add_argument("--out-dir", default=str(ROOT / "scripts" / "results"))
    p.add_argument("--no-perf-analyzer", action="store_true")
    p.add_argument("--no-readme", action="store_true", help="leave docs/performance.md as it is")
    args = p.parse_args(argv)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    plans = QUICK if args.quick else {name: SUITE[name] for name in args.models}
    results = {"machine": machine(), "models": {}}
    for name, plan in plans.items():
        results["models"][name] = run_model(name, plan, out_dir, not args.no_perf_analyzer)
    results["ratios"] = [x for r in results["models"].values() for x in ratios(r["rows"])]
    results["perf_analyzer"] = next((r["perf_analyzer"] for r in results["models"].values() if r["perf_analyzer"]),
                                    None)
    plot(results, out_dir / "ablation.png")
    results["wall_s"] = time.perf_counter() - start
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "results.md").write_text(markdown(results))
    print("\n" + markdown(results))
    if not (args.no_readme or args.quick):
        refresh_readme(RESULTS_DOC, results, out_dir)
    print(f"Results in {out_dir} ({results['wall_s'] / 60:.1f} minutes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
