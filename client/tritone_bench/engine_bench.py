"""The engine alone, in this process: the workload of scripts/benchmark without Triton, gRPC,
the detokenizers or a client, so that what serving costs on top of the engine can be read off
side by side with scripts/benchmark's figures.

At each concurrency, scripts/benchmark's protocol and measures (`tritone_bench.load`'s closed
loop over a fixed number of requests, `tritone_bench.stats`' TTFT and ITL), prompts of
--prompt-len tokens, --output-len output tokens with end of sequence ignored. Prints those, the
mean time of steps that only decode and of steps that also carry prompt tokens, the share of the
latter, and where steps go by phase; writes them as a result file.
Run it with scripts/engine_bench.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

from tritone_bench.load import measure_level
from tritone_bench.stats import Record


class EngineStreams:
    """The engine in this process as a sender: requests join the running batch as the closed loop
    sends them, and one task steps the engine while any is unfinished, timing each step."""

    def __init__(self, engine, tokenizer, temperature: float = 0.0, top_p: float = 1.0):
        self.engine, self.tokenizer = engine, tokenizer
        self.sampling = {"temperature": temperature, "top_p": top_p}
        self.ids = itertools.count()
        self.decode_steps: list[float] = []
        self.prefill_steps: list[float] = []

    async def __aenter__(self):
        from tritone.scheduling.request import SamplingParams

        self.waiting: dict[str, tuple[Record, asyncio.Event]] = {}
        self.wake = asyncio.Event()
        self.stepper = asyncio.ensure_future(self._step_forever())

        async def send(record: Record, text: str) -> None:
            request_id, done = f"{id(self)}-{next(self.ids)}", asyncio.Event()
            self.waiting[request_id] = (record, done)
            params = SamplingParams(max_tokens=record.max_tokens, end_id=-1, **self.sampling)
            self.engine.add_request(request_id, self.tokenizer(text).input_ids, params)
            self.wake.set()
            await done.wait()

        return send

    async def _step_forever(self) -> None:
        stats = self.engine.stats
        while True:
            if not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            prompt_tokens, t0 = stats.num_prompt_tokens, time.perf_counter()
            outputs = self.engine.step()
            now = time.perf_counter()
            (self.prefill_steps if stats.num_prompt_tokens > prompt_tokens else self.decode_steps).append(now - t0)
            for output in outputs:
                record, done = self.waiting[output.request_id]
                record.add(now, output.num_output_tokens)
                if output.finished:
                    record.end = now
                    del self.waiting[output.request_id]
                    done.set()
            await asyncio.sleep(0)  # the streams whose requests finished send their next ones

    async def __aexit__(self, *exc) -> None:
        self.stepper.cancel()


def step_report(engine, sender: EngineStreams, phases_before: dict, steps_before: int) -> dict:
    """Step times of a level: decode-only and with prompt tokens, and each phase per step."""
    from tritone.engine.core import PHASES

    steps = engine.stats.num_steps - steps_before
    mean = lambda xs: sum(xs) / len(xs) * 1e3 if xs else float("nan")  # noqa: E731
    return {"steps": steps, "decode_step_ms": mean(sender.decode_steps), "prefill_step_ms": mean(sender.prefill_steps),
            "prefill_share": len(sender.prefill_steps) / max(1, steps),
            "phase_ms": {p: (engine.stats.phase_seconds[p] - phases_before[p]) / max(1, steps) * 1e3
                         for p in PHASES if p != "send"}}


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from tritone.checkpoints import resolve_model
    from tritone.config import EngineConfig
    from tritone.engine.core import PHASES, LLMEngine
    from tritone_bench.results import save
    from tritone_bench.workload import PromptFactory, Workload

    p = argparse.ArgumentParser(prog="scripts/engine_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="the model over this many ranks, each a worker process (default 1: in this process)")
    p.add_argument("--requests-per-level", "--num-requests", type=int, default=0,
                   help="0: max(4, 2 x concurrency), at most 256 (scripts/benchmark's default)")
    p.add_argument("--json", help="write the results here (default: a new file under bench_results/runs/)")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_requests = [args.requests_per_level or min(256, max(4, 2 * c)) for c in args.concurrency]
    # A prompt for every request, so that the prefix cache does not shorten prefills.
    workload = Workload.fixed(PromptFactory(tokenizer), 8 + sum(num_requests), args.prompt_len, args.output_len)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=args.dtype,
                                    tensor_parallel_size=args.tensor_parallel_size))
    where = "in process" if args.tensor_parallel_size == 1 else f"over {args.tensor_parallel_size} worker processes"
    print(f"engine {where}: {engine.runner.dtype}, prompt {args.prompt_len} tokens, "
          f"output {args.output_len}, end of sequence ignored, temperature {args.temperature}, top-p {args.top_p}")
    print("| concurrency | output tok/s | TTFT mean (s) | ITL mean (ms) | decode step (ms) | step with prompt tokens (ms) "
          "| share of such steps | " + " | ".join(p for p in PHASES if p != "send") + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * (len(PHASES) - 1))
    # Warm-up: the first steps of each batch shape pay for allocations.
    warm = Workload([(text, prompt_tokens, 8) for text, prompt_tokens, _ in workload.prompts[:8]])
    measure_level(EngineStreams(engine, tokenizer), warm, 4, num_requests=8, progress=False)
    results = {"config": vars(args), "engine_dtype": str(engine.runner.dtype).removeprefix("torch."), "levels": {}}
    offset = 8
    for c, n in zip(args.concurrency, num_requests):
        sender = EngineStreams(engine, tokenizer, args.temperature, args.top_p)
        phases_before, steps_before = dict(engine.stats.phase_seconds), engine.stats.num_steps
        level = measure_level(sender, Workload(workload.prompts[offset:offset + n]), c, num_requests=n, label="engine ")
        offset += n
        level.update(step_report(engine, sender, phases_before, steps_before))
        results["levels"][c] = level
        print(f"| {c} | {level['output_tokens_per_s']:.1f} | {level['ttft_s']['mean']:.3f} "
              f"| {1000 * level['itl_s']['mean']:.1f} | {level['decode_step_ms']:.1f} | {level['prefill_step_ms']:.1f} "
              f"| {level['prefill_share']:.2f} | " + " | ".join(f"{v:.2f}" for v in level["phase_ms"].values()) + " |",
              flush=True)
    engine.shutdown()
    print(f"results: {save('engine-bench', results, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
