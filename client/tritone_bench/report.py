"""The one renderer of result files into the docs: tables between markers, from their sources.

    <!-- render: benchmark bench_results/benchmark-avx2.json -->
    ... (generated; edits are overwritten)
    <!-- end render -->

The first word names the renderer, the second its source: a result file (`tritone_bench.results`)
for the tables of measured figures, each under a line naming the machine, commit and date it came
from; or a Python module for tables read from code (`serve-options` reads the launcher's argument
parser). `scripts/render_docs` rewrites every marked block of README.md and docs/*.md; `--check`
only says which blocks differ from their sources (tests/test_docs.py runs it), so no figure and
no option is typed by hand. The benchmarks print their own figures with the same tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tritone_bench.machine import describe

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- render: (\S+) (\S+) -->\n)(.*?)(<!-- end render -->)", re.DOTALL)
NA = "n/a"


# ---------------------------------------------------------------- formatting

def _number(value: Any, fmt: str, scale: float = 1.0) -> str:
    """`value * scale` in `fmt`, or n/a for a missing or non-numeric value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return NA
    return format(value * scale, fmt)


def _pair(a: Any, b: Any, fmt: str, scale: float = 1.0) -> str:
    return f"{_number(a, fmt, scale)} / {_number(b, fmt, scale)}"


def _ratio(a: Any, b: Any) -> str:
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in (a, b)) or not b:
        return NA
    return f"{a / b:.2f}x"


def _stat(level: dict, name: str, which: str = "mean") -> Any:
    """A latency statistic of a level (`tritone_bench.stats.level_stats`): `ttft` or `itl`, in seconds."""
    return (level.get(f"{name}_s") or {}).get(which)


def _levels(*stacks: dict) -> list:
    """The concurrency keys of the stacks, in numeric order (JSON keys are strings)."""
    keys = {k for stack in stacks for k in (stack or {})}
    return sorted(keys, key=lambda k: float(k) if str(k).replace(".", "", 1).isdigit() else math.inf)


# ---------------------------------------------------------------- renderers of benchmark JSON

def structured_table(results: dict) -> str:
    """`scripts/benchmark --structured`: each stack free and with every request under one JSON
    schema, and the first token of a new schema against a cached one."""
    lines = ["| stack | concurrency | free tok/s | JSON schema tok/s | schema / free | first token, new schema (s) "
             "| first token, cached schema (s) |", "|---|---|---|---|---|---|---|"]
    for name, free_key, key, ttft_key in (("Tritone", "tritone", "tritone_structured", "schema_ttft"),
                                          ("vLLM CPU", "peer", "peer_structured", "peer_schema_ttft")):
        ttft = results.get(ttft_key) or {}
        for c, constrained in (results.get(key) or {}).items():
            free = results[free_key][c]
            lines.append(f"| {name} | {c} | {free['output_tokens_per_s']:.1f} | {constrained['output_tokens_per_s']:.1f} "
                         f"| {constrained['output_tokens_per_s'] / free['output_tokens_per_s']:.2f}x "
                         f"| {ttft.get('new_schema_ttft_s', float('nan')):.3f} "
                         f"| {ttft.get('cached_schema_ttft_s', float('nan')):.3f} |")
    tr, peer = results.get("tritone_structured") or {}, results.get("peer_structured") or {}
    ratios = [f"concurrency {c}: {tr[c]['output_tokens_per_s'] / peer[c]['output_tokens_per_s']:.2f}x"
              for c in tr if c in peer]
    if ratios:
        lines += ["", "Tritone / vLLM, every request under the schema: " + ", ".join(ratios) + "."]
    return "\n".join(lines)


# vLLM's front end, as scripts/benchmark names its processes (tritone_bench.proc_cpu.role): the
# process that serves HTTP and detokenizes, and the one that schedules; its model runs in a worker.
PEER_FRONT_END = ("vllm api server", "vllm engine core")


def _front_end_ms(cpu: dict) -> float | None:
    present = [cpu[role] for role in PEER_FRONT_END if isinstance(cpu.get(role), (int, float))]
    return sum(present) if present else None


def headline_table(results: dict) -> str:
    """`scripts/benchmark --peer vllm`: Tritone against vLLM's CPU build, level by level."""
    tr, peer = results.get("tritone") or {}, results.get("peer") or {}
    lines = ["| concurrency | Tritone tok/s | vLLM tok/s | Tritone/vLLM | ITL mean Tritone / vLLM (ms) "
             "| TTFT mean Tritone / vLLM (s) | text path CPU ms/token: Tritone / vLLM front end |",
             "|---|---|---|---|---|---|---|"]
    for c in _levels(tr, peer):
        t, v = tr.get(c) or {}, peer.get(c) or {}
        t_cpu, v_cpu = t.get("cpu_ms_per_token") or {}, v.get("cpu_ms_per_token") or {}
        lines.append(f"| {c} | {_number(t.get('output_tokens_per_s'), '.1f')} "
                     f"| {_number(v.get('output_tokens_per_s'), '.1f')} "
                     f"| {_ratio(t.get('output_tokens_per_s'), v.get('output_tokens_per_s'))} "
                     f"| {_pair(_stat(t, 'itl'), _stat(v, 'itl'), '.1f', 1000.0)} "
                     f"| {_pair(_stat(t, 'ttft'), _stat(v, 'ttft'), '.2f')} "
                     f"| {_pair(t_cpu.get('text path'), _front_end_ms(v_cpu), '.3f')} |")
    return "\n".join(lines)


def vllm_bench_table(results: dict) -> str:
    """Both stacks through their OpenAI API, measured by vLLM's own client (`vllm bench serve`)."""
    tr, peer = results.get("tritone_vllm_bench") or {}, results.get("peer_vllm_bench") or {}
    lines = ["| concurrency | vLLM tok/s | Tritone tok/s | Tritone/vLLM | mean TPOT vLLM / Tritone (ms) "
             "| mean TTFT vLLM / Tritone (ms) |", "|---|---|---|---|---|---|"]
    for c in _levels(tr, peer):
        t, v = tr.get(c) or {}, peer.get(c) or {}
        lines.append(f"| {c} | {_number(v.get('output_throughput'), '.1f')} | {_number(t.get('output_throughput'), '.1f')} "
                     f"| {_ratio(t.get('output_throughput'), v.get('output_throughput'))} "
                     f"| {_pair(v.get('mean_tpot_ms'), t.get('mean_tpot_ms'), '.1f')} "
                     f"| {_pair(v.get('mean_ttft_ms'), t.get('mean_ttft_ms'), '.0f')} |")
    return "\n".join(lines)


def benchmark_tables(results: dict) -> str:
    """`scripts/benchmark`: every level of each stack, Tritone's engine steps by phase, and the CPU
    each process of each stack spends per output token (as the script prints them)."""
    stacks = (("Tritone", results.get("tritone") or {}), ("vLLM CPU", results.get("peer") or {}))
    lines = ["| stack | concurrency | output tok/s | TTFT mean / p99 (s) | ITL mean / p99 (ms) "
             "| tokens per response | forward-busy |", "|---|---|---|---|---|---|---|"]
    for name, levels in stacks:
        for c in _levels(levels):
            r = levels[c]
            lines.append(f"| {name} | {c} | {_number(r.get('output_tokens_per_s'), '.1f')} "
                         f"| {_pair(_stat(r, 'ttft'), _stat(r, 'ttft', 'p99'), '.3f')} "
                         f"| {_pair(_stat(r, 'itl'), _stat(r, 'itl', 'p99'), '.1f', 1000.0)} "
                         f"| {_number(r.get('tokens_per_response'), '.2f')} "
                         f"| {_number(r.get('forward_busy'), '.2f') if 'forward_busy' in r else ''} |")
    for b, r in sorted((results.get("hf_generate") or {}).items(), key=lambda kv: float(kv[0])):
        lines.append(f"| HF generate, static batch | {b} | {_number(r.get('output_tokens_per_s'), '.1f')} | "
                     f"| {_number(r.get('step_s'), '.1f', 1000.0)} per step | | |")

    tritone = results.get("tritone") or {}
    steps = [(c, tritone[c]["step_ms"]) for c in _levels(tritone) if tritone[c].get("step_ms")]
    if steps:
        phases = [p for p in ("schedule", "prepare", "forward", "sample", "update", "send")
                  if any(p in s for _, s in steps)]
        lines += ["", "Tritone's engine, milliseconds per step by phase (send: the sender thread, beside the next "
                      "step):", "", "| concurrency | steps | " + " | ".join(phases) + " |",
                  "|---|---|" + "---|" * len(phases)]
        lines += [f"| {c} | {_number(s.get('steps'), '.0f')} | " + " | ".join(_number(s.get(p), ".2f") for p in phases)
                  + " |" for c, s in steps]

    rows = [(name, c, levels[c]["cpu_ms_per_token"]) for name, levels in stacks for c in _levels(levels)
            if levels[c].get("cpu_ms_per_token")]
    if rows:
        roles = sorted({role for *_, cpu in rows for role in cpu}, key=lambda role: (role == "text path", role))
        lines += ["", "CPU milliseconds per output token, by process (text path: tritonserver + preprocessing + "
                      "postprocessing; other: a process the stack starts that has no role of its own):", "",
                  "| stack | concurrency | " + " | ".join(roles) + " |", "|---|---|" + "---|" * len(roles)]
        lines += [f"| {name} | {c} | " + " | ".join(_number(cpu[role], ".3f") if role in cpu else "" for role in roles)
                  + " |" for name, c, cpu in rows]
    return "\n".join(lines)


def openai_throughput_table(results: dict) -> str:
    """`scripts/openai_throughput`: the same streaming load straight to the ensemble over gRPC and
    through tritone-openai, level by level: tok/s pooled over the rounds (each round's ratio too,
    where the run had rounds), and the front end's own CPU per output token."""
    rows = results.get("levels") or []
    lines = ["| concurrency | gRPC tok/s | tritone-openai tok/s | OpenAI / gRPC | by round | front end CPU (ms/token) "
             "| TTFT p50 gRPC / OpenAI (s) | ITL p50 gRPC / OpenAI (ms) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        g, o = row.get("grpc") or {}, row.get("openai") or {}
        rounds = ", ".join(_number(r, ".2f") for r in row.get("round_ratios") or []) or NA
        front_end = (o.get("cpu_ms_per_token") or {}).get("openai front end")
        lines.append(f"| {row.get('concurrency', NA)} | {_number(g.get('output_tokens_per_s'), '.1f')} "
                     f"| {_number(o.get('output_tokens_per_s'), '.1f')} "
                     f"| {_ratio(o.get('output_tokens_per_s'), g.get('output_tokens_per_s'))} | {rounds} "
                     f"| {_number(front_end, '.3f')} "
                     f"| {_pair(_stat(g, 'ttft', 'p50'), _stat(o, 'ttft', 'p50'), '.3f')} "
                     f"| {_pair(_stat(g, 'itl', 'p50'), _stat(o, 'itl', 'p50'), '.1f', 1000.0)} |")
    return "\n".join(lines)


def runs_table(runs: dict) -> str:
    """Runs of `scripts/benchmark` one after the other, each with one change (`runs`: the command
    of each and its JSON, by label): Tritone's throughput and CPU per output token by process."""
    lines = [f"`{runs.get('command', '')}`, one run per row pair, in this order:", "",
             "| run | concurrency | tok/s | tritonserver | postprocessing | preprocessing | text path | llm |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs.get("runs", []):
        tritone = (run.get("results") or {}).get("tritone") or {}
        for i, c in enumerate(_levels(tritone)):
            level, cpu = tritone[c], dict(tritone[c].get("cpu_ms_per_token") or {})
            cpu.setdefault("llm", cpu.get("llm_inline"))  # the engine's process, whichever model it serves
            lines.append(f"| {run.get('label', NA) if i == 0 else ''} | {c} "
                         f"| {_number(level.get('output_tokens_per_s'), '.1f')} "
                         + " ".join(f"| {_number(cpu.get(k), '.3f')}" for k in
                                    ("tritonserver", "postprocessing", "preprocessing", "text path", "llm"))
                         + " |")
    lines += ["", "(milliseconds of CPU per output token, `/proc/<pid>/stat` of each process over the level)"]
    return "\n".join(lines)


def parallel_table(runs: dict) -> str:
    """`scripts/benchmark` once per parallel layout (`runs`: the command and each run's JSON, by
    label): throughput, latency and the CPU per output token of the engine's processes."""
    lines = [f"`{runs.get('command', '')}`, one run after the other:", "",
             "| layout | concurrency | tok/s | ITL mean (ms) | TTFT mean (s) | llm process | llm workers | text path |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs.get("runs", []):
        tritone = (run.get("results") or {}).get("tritone") or {}
        for i, c in enumerate(_levels(tritone)):
            level, cpu = tritone[c], tritone[c].get("cpu_ms_per_token") or {}
            lines.append(f"| {run.get('label', NA) if i == 0 else ''} | {c} "
                         f"| {_number(level.get('output_tokens_per_s'), '.1f')} "
                         f"| {_number(_stat(level, 'itl'), '.1f', 1000.0)} "
                         f"| {_number(_stat(level, 'ttft'), '.2f')} "
                         + " ".join(f"| {_number(cpu.get(k), '.2f')}" for k in ("llm", "llm workers", "text path"))
                         + " |")
    lines += ["", "(CPU: milliseconds per output token, `/proc/<pid>/stat` of each process over the level)"]
    return "\n".join(lines)


def suite_tables(results: dict) -> str:
    """`scripts/bench_suite`: each model's levels on both stacks, Hugging Face `generate`, the
    ensemble over `llm_inline` level by level, and perf_analyzer's run."""
    lines = []
    for name, r in (results.get("models") or {}).items():
        (sp, so), (lp, lo) = r["short"], r["long"]
        lines += [f"**{name} model** (short: {sp} prompt tokens, {so} output; long: {lp} prompt tokens, {lo} "
                  "output; chat: a long-tailed mix of lengths)", "",
                  "| configuration | load | output tok/s | req/s | goodput req/s | TTFT p50 / p99 (s) "
                  "| ITL p50 / p99 (ms) | E2E p50 / p99 (s) | forward-busy |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            load = f"{row['rate']}/s" if row.get("rate") else row.get("concurrency")
            lines.append(f"| {row['model']}, {row['prompts']}, {row['stack']} | {load} "
                         f"| {_number(row.get('output_tokens_per_s'), '.0f')} | {_number(row.get('requests_per_s'), '.2f')} "
                         f"| {_number(row.get('goodput_requests_per_s'), '.2f')} "
                         f"| {_pair(_stat(row, 'ttft', 'p50'), _stat(row, 'ttft', 'p99'), '.3f')} "
                         f"| {_pair(_stat(row, 'itl', 'p50'), _stat(row, 'itl', 'p99'), '.1f', 1000.0)} "
                         f"| {_pair(_stat(row, 'e2e', 'p50'), _stat(row, 'e2e', 'p99'), '.2f')} "
                         f"| {_number(row.get('forward_busy'), '.2f')} |")
        if r.get("hf_generate"):
            lines += ["", "| Hugging Face generate (short prompts) | static batch | output tok/s | step (ms) |",
                      "|---|---|---|---|"]
            lines += [f"| {name} | {h['batch']} | {_number(h.get('output_tokens_per_s'), '.0f')} "
                      f"| {_number(h.get('step_s'), '.1f', 1000.0)} |" for h in r["hf_generate"]]
        lines.append("")
    lines += ["Three-stage `ensemble` over single-process `llm_inline`, level by level:", "",
              "| model | prompts | load | tok/s ratio | ITL p99 ratio | forward-busy ensemble / inline |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {x['model']} | {x['prompts']} | {x['load']} | {_number(x.get('throughput_ratio'), '.2f')} "
              f"| {_number(x.get('itl_p99_ratio'), '.2f')} | {_pair(x.get('busy_ensemble'), x.get('busy_inline'), '.2f')} |"
              for x in results.get("ratios") or []]
    pa = results.get("perf_analyzer")
    if pa and "error" not in pa:
        lines += ["", f"perf_analyzer `--streaming` against `ensemble` (tiny model, concurrency {pa['concurrency']}): "
                      f"{_number(pa.get('requests_per_s'), '.1f')} requests/s, "
                      f"{_number(pa.get('output_tokens_per_s'), '.0f')} output tokens/s, TTFT mean "
                      f"{_number(_stat(pa, 'ttft'), '.0f', 1000.0)} ms, ITL mean {_number(_stat(pa, 'itl'), '.1f', 1000.0)} "
                      f"ms (p99 {_number(_stat(pa, 'itl', 'p99'), '.1f', 1000.0)} ms)."]
    return "\n".join(lines)


# ---------------------------------------------------------------- renderers of code

def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off" if action.default is False else "on"
    if isinstance(action, argparse._StoreFalseAction):  # a flag that turns off what is on
        return "off" if action.default is True else "on"
    if action.default is None:
        return "none"
    return f"`{_cell(action.default)}`"


def options_table(parser: argparse.ArgumentParser) -> str:
    """Every option of `parser` (but --help): its default and what it does."""
    lines = ["| option | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        what = action.help if action.help and action.help != argparse.SUPPRESS else ""
        what = what.removesuffix(f" (default {action.default})")  # the table has a column for it
        if action.choices:
            what = (what + "; " if what else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        lines.append(f"| {names} | {_default(action)} | {_cell(what)} |")
    return "\n".join(lines)


def _module(source: pathlib.Path):
    """Imports the module that `source` is (backends/tritone/launcher.py: tritone.launcher)."""
    relative = source.resolve().relative_to(ROOT.resolve())
    if relative.parts[0] in ("backends", "client"):
        root, relative = ROOT / relative.parts[0], pathlib.Path(*relative.parts[1:])
        if str(root) not in sys.path:  # the editable install puts it there; a bare checkout does not
            sys.path.insert(0, str(root))
    return importlib.import_module(".".join(relative.with_suffix("").parts))


def serve_options(source: pathlib.Path) -> str:
    """`scripts/serve`'s options, from the launcher's `build_parser()`."""
    return options_table(_module(source).build_parser())


# ---------------------------------------------------------------- the renderers

@dataclass(frozen=True)
class Renderer:
    table: Callable[[Any], str]
    # "json": the source is a benchmark's JSON, rendered under a line naming the machine and
    # workload; "code": the source is a Python file of this checkout, handed over as its path.
    reads: str = "json"
    # The command that writes a JSON source, shown in the block while the source does not exist.
    produced_by: str = ""


RENDERERS = {
    "structured": Renderer(structured_table,
                           produced_by="scripts/benchmark --structured json-schema --peer vllm --json SOURCE"),
    "headline": Renderer(headline_table, produced_by="scripts/benchmark --peer vllm --hf-batches --json SOURCE"),
    "vllm-bench": Renderer(vllm_bench_table,
                           produced_by="scripts/benchmark --peer vllm --vllm-bench --hf-batches --json SOURCE"),
    "benchmark": Renderer(benchmark_tables, produced_by="scripts/benchmark --peer vllm --hf-batches --json SOURCE"),
    "openai-throughput": Renderer(openai_throughput_table, produced_by="scripts/openai_throughput --json SOURCE"),
    "runs": Renderer(runs_table, produced_by="scripts/benchmark --json, once per run"),
    "parallel": Renderer(parallel_table, produced_by="scripts/benchmark --json, once per layout"),
    "bench-suite": Renderer(suite_tables, produced_by="scripts/bench_suite --json SOURCE"),
    "serve-options": Renderer(serve_options, reads="code"),
}


def measured_head(results: Any) -> str:
    """The machine, commit and date a result file records, and the workload (what each stack ran in)."""
    if not isinstance(results, dict) or "machine" not in results:
        return "Machine not recorded"
    commit = results.get("commit") or "unknown"
    head = (f"Measured on a {describe(results['machine'])}, at commit {commit[:12]}{'-dirty' * commit.endswith('-dirty')}"
            f" on {str(results.get('date') or 'an unknown date')[:10]}"
            + (" (commit and date from git: the run did not record them)" if results.get("provenance") else ""))
    config = results.get("config", {})
    if config.get("prompt_len"):
        head += (f"; {config.get('prompt_len')}-token prompts, {config.get('output_len')} output tokens, "
                 f"Tritone {results.get('tritone_dtype')}"
                 + (f" (pipeline {results['tritone_pipeline']})" if results.get("tritone_pipeline") else "")
                 + (f", vLLM {results['peer_dtype']} on {results['peer_threads']} engine thread(s)"
                    if results.get("peer_dtype") else "")
                 + ("; both servers up, the stacks taking turns level by level" if config.get("interleave") else
                    "; one stack after the other" if results.get("peer_dtype") else ""))
    return head


def renderer(name: str) -> Renderer:
    if name not in RENDERERS:
        raise ValueError(f"no renderer {name!r} (known: {', '.join(sorted(RENDERERS))})")
    return RENDERERS[name]


def load(name: str, source: str) -> Any:
    """What renderer `name` renders from `source` (a path from the repository root): the parsed
    JSON (None while the file does not exist yet), or the path of a code source."""
    path = ROOT / source
    if renderer(name).reads == "code":
        if not path.exists():
            raise FileNotFoundError(f"render {name}: no source file {source}")
        return path
    return json.loads(path.read_text()) if path.exists() else None


def render(name: str, data: Any, source: str = "SOURCE") -> str:
    """A block's text: `data` as `load` returns it."""
    r = renderer(name)
    if r.reads == "code":
        return f"{r.table(data)}\n"
    if data is None:
        return (f"Not measured yet: `{r.produced_by.replace('SOURCE', source)}` writes `{source}`, then "
                f"`scripts/render_docs` fills this in.\n")
    return f"{measured_head(data)}:\n\n{r.table(data)}\n"


def rendered(text: str) -> str:
    def block(m):
        name, source = m.group(2), m.group(3)
        return m.group(1) + render(name, load(name, source), source) + m.group(5)

    return BLOCK.sub(block, text)


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def stale() -> list[str]:
    """The documents whose rendered blocks differ from their sources."""
    return [str(p.relative_to(ROOT)) for p in documents() if rendered(p.read_text()) != p.read_text()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/render_docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report the documents that are out of date")
    args = p.parse_args(argv)
    if args.check:
        out = stale()
        for path in out:
            print(f"{path}: rendered blocks differ from their sources (run scripts/render_docs)")
        return 1 if out else 0
    for path in documents():
        text = path.read_text()
        new = rendered(text)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
