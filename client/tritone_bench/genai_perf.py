"""genai-perf against Tritone's ensemble, and its token counts against the server's.

genai-perf counts a request's output tokens by tokenizing the text it received; the server counts
the tokens it generated (`num_output_tokens`, which perf_analyzer records with every response).
This runs `genai-perf profile -m ensemble --endpoint-type kserve --backend tensorrtllm --streaming`
with the model's own tokenizer directory, prints genai-perf's figures, and fails unless its
output (and input) sequence lengths match the server's counts. Run it with scripts/genai_perf,
which installs genai-perf in an environment of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

from tritone.checkpoints import resolve_model
from tritone.launcher import temporary_server
from tritone_bench.results import RUNS
from tritone_bench.stats import percentile


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/genai_perf", description=__doc__.split("\n\n")[0],
                                epilog="Options after -- go to genai-perf as they are.")
    p.add_argument("--url", help="gRPC address of a running Tritone server (default: start one here)")
    p.add_argument("--model", help="model directory: the started server's, and genai-perf's tokenizer "
                                   "(default: the default model)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32, help="requests to measure (default 32)")
    p.add_argument("--input-tokens", type=int, default=64, help="synthetic prompt length (default 64)")
    p.add_argument("--output-tokens", type=int, default=32,
                   help="mean max_tokens of the requests (default 32, spread by a quarter of that)")
    p.add_argument("--artifact-dir", default=str(RUNS / "genai-perf"),
                   help="where genai-perf writes its exports (emptied first)")
    p.add_argument("genai_perf_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.genai_perf_args[:1] == ["--"]:
        args.genai_perf_args = args.genai_perf_args[1:]
    return args


def genai_perf_command(args, url: str, tokenizer_dir: pathlib.Path, artifacts: pathlib.Path) -> list[str]:
    return [
        str(pathlib.Path(os.environ["TRITONE_GENAI_PERF_BIN"]) / "genai-perf"), "profile",
        "-m", "ensemble", "--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming",
        "-u", url, "--tokenizer", str(tokenizer_dir),
        "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", str(args.output_tokens // 4),
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--num-dataset-entries", str(args.requests), "--random-seed", "0",
        # genai-perf's prompt is the whole input, as with TensorRT-LLM: no chat template around it.
        "--extra-inputs", "apply_chat_template:false",
        # No --warmup-request-count: perf_analyzer 2.51 stalls after its warm-up requests.
        "--artifact-dir", str(artifacts),
        *args.genai_perf_args,
    ]


def run_genai_perf(command: list[str]) -> None:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.environ["TRITONE_GENAI_PERF_BIN"], env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (os.environ["TRITONE_PERF_ANALYZER_LIBS"],
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    print("Running:", " ".join(command), flush=True)
    code = subprocess.call(command, env=env)
    if code != 0:
        raise RuntimeError(f"genai-perf failed with exit code {code}")


def server_counts(export: pathlib.Path) -> tuple[list[int], list[int]]:
    """Per request, num_input_tokens and num_output_tokens from its last response."""
    inputs, outputs = [], []
    for experiment in json.loads(export.read_text())["experiments"]:
        for request in experiment["requests"]:
            last = request["response_outputs"][-1]
            inputs.append(int(last["num_input_tokens"]))
            outputs.append(int(last["num_output_tokens"]))
    return inputs, outputs


def summary(values: list[int]) -> dict[str, float]:
    return {"avg": statistics.fmean(values), "min": min(values), "max": max(values),
            "p50": percentile(values, 50)}


def compare(name: str, reported: dict, counts: list[int]) -> bool:
    ours = summary(counts)
    theirs = {k: float(reported[k]) for k in ours}
    ok = all(abs(ours[k] - theirs[k]) < 1e-6 for k in ours)
    print(f"{name:<24}" + "  ".join(f"{k} {theirs[k]:8.2f}" for k in ours) + "   (genai-perf)")
    print(f"{'':<24}" + "  ".join(f"{k} {ours[k]:8.2f}" for k in ours) + "   (server)  "
          + ("match" if ok else "MISMATCH"))
    return ok


def report(artifacts: pathlib.Path) -> bool:
    stats_file = next(artifacts.rglob("profile_export_genai_perf.json"), None)
    export = next(artifacts.rglob("profile_export.json"), None)
    if stats_file is None or export is None:
        raise RuntimeError(f"genai-perf left no profile exports under {artifacts}")
    stats = json.loads(stats_file.read_text())
    num_inputs, num_outputs = server_counts(export)
    print(f"\n{len(num_outputs)} requests; exports in {stats_file.parent}")
    for key, label in (("output_token_throughput", "output tokens/s"), ("request_throughput", "requests/s"),
                       ("time_to_first_token", "TTFT (ms)"), ("inter_token_latency", "ITL (ms)")):
        value = stats[key]
        print(f"{label:<24}avg {value['avg']:8.2f}" + (f"  p99 {value['p99']:8.2f}" if "p99" in value else ""))
    ok = compare("output sequence length", stats["output_sequence_length"], num_outputs)
    ok &= compare("input sequence length", stats["input_sequence_length"], num_inputs)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("TRITONE_GENAI_PERF_BIN", "TRITONE_PERF_ANALYZER_LIBS"):
        if name not in os.environ:
            print("error: run this through scripts/genai_perf, which installs genai-perf", file=sys.stderr)
            return 2
    model_dir = resolve_model(args.model)
    artifacts = pathlib.Path(args.artifact_dir).resolve()
    shutil.rmtree(artifacts, ignore_errors=True)  # perf_analyzer refuses to overwrite its export
    artifacts.mkdir(parents=True)
    try:
        with contextlib.ExitStack() as stack:
            url = args.url
            if url is None:
                server = stack.enter_context(temporary_server(artifacts / "server.log",
                                                              *(["--model", args.model] if args.model else [])))
                url = f"{server.args.host}:{server.args.grpc_port}"
            run_genai_perf(genai_perf_command(args, url, model_dir, artifacts))
            ok = report(artifacts)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("error: genai-perf's token counts differ from the server's num_output_tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
