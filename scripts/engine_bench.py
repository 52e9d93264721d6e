"""The engine alone, in this process: the workload of scripts/benchmark without Triton, gRPC,
the detokenizers or a client, so that what serving costs on top of the engine can be read off
side by side with scripts/benchmark's figures.

At each concurrency, scripts/benchmark's protocol: a closed loop (a finished request is replaced
at once) over a fixed number of requests, prompts of --prompt-len token ids, --output-len output
tokens with end of sequence ignored; output tokens/s over the level's whole time. Prints that,
the mean time of steps that only decode and of steps that also carry prompt tokens, the share of
the latter, and where steps go by phase.
Run it with scripts/engine_bench.
"""

from __future__ import annotations

import argparse
import time

from tritone.config import EngineConfig
from tritone.engine.core import PHASES, LLMEngine
from tritone.models import resolve_model
from tritone.scheduling.request import SamplingParams


def run_level(engine: LLMEngine, concurrency: int, num_requests: int, prompt_len: int, output_len: int,
              first_id: int, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """`num_requests` requests, `concurrency` at a time: scripts/benchmark's protocol, whose
    output tokens/s are all output tokens over the level's whole time."""
    params = SamplingParams(max_tokens=output_len, end_id=-1, temperature=temperature, top_p=top_p)
    vocab = engine.vocab_size
    serial, submitted, finished = first_id, 0, 0

    def add():
        nonlocal serial, submitted
        # Distinct prompts, so that the prefix cache does not shorten prefills.
        engine.add_request(str(serial), [(serial * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(prompt_len)],
                           params)
        serial += 1
        submitted += 1

    phases_before, steps_before = dict(engine.stats.phase_seconds), engine.stats.num_steps
    start = time.perf_counter()
    for _ in range(min(concurrency, num_requests)):
        add()
    tokens, decode_steps, prefill_steps = 0, [], []
    while finished < num_requests:
        prompt_tokens = engine.stats.num_prompt_tokens
        t0 = time.perf_counter()
        outputs = engine.step()
        (prefill_steps if engine.stats.num_prompt_tokens > prompt_tokens else decode_steps).append(
            time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outputs)
        for output in outputs:
            if output.finished:
                finished += 1
                if submitted < num_requests:
                    add()
    elapsed = time.perf_counter() - start
    steps = engine.stats.num_steps - steps_before
    mean = lambda xs: sum(xs) / len(xs) * 1e3 if xs else float("nan")
    return {
        "concurrency": concurrency, "tok_s": tokens / elapsed, "steps": steps,
        "decode_step_ms": mean(decode_steps), "prefill_step_ms": mean(prefill_steps),
        "prefill_share": len(prefill_steps) / max(1, steps),
        "phase_ms": {p: (engine.stats.phase_seconds[p] - phases_before[p]) / max(1, steps) * 1e3
                     for p in PHASES if p != "send"},
        "next_id": serial,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="the model over this many ranks, each a worker process (default 1: in this process)")
    p.add_argument("--requests-per-level", type=int, default=0,
                   help="0: max(4, 2 x concurrency), at most 256 (scripts/benchmark's default)")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=str(resolve_model(args.model)), dtype=args.dtype,
                                    tensor_parallel_size=args.tensor_parallel_size))
    where = "in process" if args.tensor_parallel_size == 1 else f"over {args.tensor_parallel_size} worker processes"
    print(f"engine {where}: {engine.runner.dtype}, prompt {args.prompt_len} tokens, "
          f"output {args.output_len}, end of sequence ignored, temperature {args.temperature}, top-p {args.top_p}")
    print("| concurrency | output tok/s | decode step (ms) | step with prompt tokens (ms) | share of such steps | "
          + " | ".join(p for p in PHASES if p != "send") + " |")
    print("|---|---|---|---|---|" + "---|" * (len(PHASES) - 1))
    # Warm-up: the first steps of each batch shape pay for allocations.
    next_id = run_level(engine, 4, 8, args.prompt_len, 8, 0)["next_id"]
    for c in args.concurrency:
        num = args.requests_per_level or min(256, max(4, 2 * c))
        r = run_level(engine, c, num, args.prompt_len, args.output_len, next_id, args.temperature, args.top_p)
        next_id = r["next_id"]
        print(f"| {c} | {r['tok_s']:.1f} | {r['decode_step_ms']:.1f} | {r['prefill_step_ms']:.1f} | "
              f"{r['prefill_share']:.2f} | " + " | ".join(f"{v:.2f}" for v in r["phase_ms"].values()) + " |",
              flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
