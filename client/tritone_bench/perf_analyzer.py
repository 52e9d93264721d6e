"""NVIDIA's perf_analyzer against Tritone's ensemble, over decoupled gRPC streaming.

Writes an input-data file of synthetic prompts (exact token lengths, no chat template, end of
sequence ignored), runs `perf_analyzer -m ensemble -i grpc --streaming` at each concurrency, and
reads its profile export (a timestamp per streamed response, with the server's
num_output_tokens) to report output tokens/s, time to first token and inter-token latency as
every benchmark here measures them (`tritone_bench.stats`), beside perf_analyzer's own requests/s. Run it with scripts/perf_analyzer, which links the
libraries the perf_analyzer 2.51 binary needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys

from tritone_bench.results import RUNS
from tritone_bench.stats import Record, level_stats


def write_input_data(path: pathlib.Path, prompts: list[str], max_tokens: int) -> pathlib.Path:
    """perf_analyzer's input-data JSON: one entry per prompt, the ensemble's inputs by name."""
    entries = [{"text_input": [p], "max_tokens": [max_tokens], "end_id": [-1], "stream": [True],
                "apply_chat_template": [False]} for p in prompts]
    path.write_text(json.dumps({"data": entries}))
    return path


def perf_analyzer_command(url: str, data: pathlib.Path, concurrency: int, interval_ms: int,
                          export: pathlib.Path, model: str = "ensemble") -> list[str]:
    binary = pathlib.Path(sys.executable).parent / "perf_analyzer"
    return [str(binary), "-m", model, "-u", url, "-i", "grpc", "--streaming", "--input-data", str(data),
            "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows",
            "--measurement-interval", str(interval_ms), "--max-trials", "3", "--stability-percentage", "50",
            # No warm-up requests: perf_analyzer 2.51 stalls after them.
            "--profile-export-file", str(export)]


def run_perf_analyzer(command: list[str], log: pathlib.Path) -> str:
    env = dict(os.environ)
    libs = os.environ.get("TRITONE_PERF_ANALYZER_LIBS")
    if not libs:
        raise RuntimeError("run this through scripts/perf_analyzer, which links the libraries perf_analyzer needs")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH", "")) if p)
    print("Running:", " ".join(command), flush=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed with exit code {result.returncode}: {result.stdout[-2000:]}"
                           f"{result.stderr[-2000:]}")
    return result.stdout


def summarize_export(export: pathlib.Path) -> dict:
    """Throughput and latencies of the last (reported) experiment from the profile export."""
    experiment = json.loads(export.read_text())["experiments"][-1]
    records = []
    for r in experiment["requests"]:
        if not r.get("response_timestamps"):
            continue
        record = Record(start=r["timestamp"] / 1e9, max_tokens=0, end=r["response_timestamps"][-1] / 1e9)
        for when, output in zip(r["response_timestamps"], r["response_outputs"]):
            record.add(when / 1e9, int(output["num_output_tokens"]))
        records.append(record)
    window = (min(r.start for r in records), max(r.end for r in records) + 1e-9)
    return {"concurrency": experiment["experiment"]["value"], **level_stats(records, window)}


def profile(url: str, prompts: list[str], max_tokens: int, concurrency: int, interval_ms: int,
            out_dir: pathlib.Path) -> dict:
    """One perf_analyzer run at one concurrency; its files land in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = write_input_data(out_dir / "input_data.json", prompts, max_tokens)
    export = out_dir / f"profile_export_c{concurrency}.json"
    export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
    stdout = run_perf_analyzer(perf_analyzer_command(url, data, concurrency, interval_ms, export),
                               out_dir / f"perf_analyzer_c{concurrency}.log")
    summary = summarize_export(export)
    summary["perf_analyzer_lines"] = [line.strip() for line in stdout.splitlines()
                                      if "Throughput:" in line or "latency" in line.lower()]
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/perf_analyzer", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="gRPC address of a running Tritone server (default: start one here)")
    p.add_argument("--model", help="model directory for the started server and the prompts' tokenizer "
                                   "(default: the default model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--measurement-interval", type=int, default=5000, help="milliseconds per measurement window")
    p.add_argument("--out-dir", default=str(RUNS / "perf_analyzer"),
                   help="where its input data, logs and profile exports go")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from tritone.launcher import temporary_server
    from tritone.checkpoints import resolve_model
    from tritone_bench.workload import PromptFactory

    model_dir = resolve_model(args.model)
    factory = PromptFactory(AutoTokenizer.from_pretrained(model_dir))
    prompts = [factory.make(args.prompt_tokens) for _ in range(64)]
    out_dir = pathlib.Path(args.out_dir)
    try:
        with contextlib.ExitStack() as stack:
            url = args.url
            if url is None:
                out_dir.mkdir(parents=True, exist_ok=True)
                server = stack.enter_context(temporary_server(out_dir / "server.log", "--model", str(model_dir)))
                url = f"{server.args.host}:{server.args.grpc_port}"
            for c in args.concurrency:
                s = profile(url, prompts, args.output_tokens, c, args.measurement_interval, out_dir)
                print("\n".join(s.pop("perf_analyzer_lines")))
                print(json.dumps(s, indent=2), flush=True)
    except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
