"""Load generator: streams requests to a Tritone model over gRPC and measures what users see.

Closed loop (a fixed number of requests in flight) or open loop (Poisson arrivals at a set
rate), synthetic prompts of exact token lengths or a long-tailed mix like chat traffic, all
seeded. Each level runs for a fixed measurement window after a warm-up, so a level takes the
same time whatever the server's speed; requests still running at its end finish unmeasured.
Reports time to first token, time between streamed responses (inter-token latency), end-to-end
latency, output tokens/s, requests/s, goodput under latency targets, and the engine's
forward-busy fraction read from the server's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from tritone_client.client import infer_inputs

# English words that most tokenizers hold as one token both alone and after a space, so that a
# prompt of N words is N tokens; each tokenizer's own check keeps only those that are.
_WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one had not "
          "but what all were when we there can an your which their said if do will each about how up out them "
          "then she many some so these would other into has more her two like him see time could no make than "
          "first been its who now people my made over did down only way find use may water long little very "
          "after words called just where most know day get come number sound work place year back live give "
          "name good man think say great help line turn cause much mean old same tell boy follow came want "
          "show also around form three small set put end does another well large must big even such because "
          "here why ask went men read need land different home us move try kind hand picture again change off "
          "play spell air away animal house point page letter mother answer found study still learn should").split()

# Chat-like lengths: log-normal, so most requests are short and a few are long (medians and
# spreads in the range public chat traces show), clipped to the given bounds.
CHAT_MIX = {"prompt_median": 200, "prompt_sigma": 1.0, "output_median": 100, "output_sigma": 0.8}


# ---------------------------------------------------------------- pure parts (unit-tested)

def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(values) -> dict[str, float]:
    """Mean, median, p90 and p99 (NaN for no values)."""
    values = list(values)
    return {"mean": float(np.mean(values)) if values else float("nan"), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def poisson_arrivals(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def chat_lengths(num: int, seed: int = 0, max_prompt: int = 4000, max_output: int = 1000,
                 mix: dict = CHAT_MIX) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) pairs drawn from the long-tailed chat mix."""
    rng = random.Random(seed)

    def draw(median, sigma, upper):
        return max(1, min(upper, round(rng.lognormvariate(math.log(median), sigma))))

    return [(draw(mix["prompt_median"], mix["prompt_sigma"], max_prompt),
             draw(mix["output_median"], mix["output_sigma"], max_output)) for _ in range(num)]


class PromptFactory:
    """Texts of an exact number of tokens (as the tokenizer counts them, special tokens
    included), made of random words: seeded, and different from each other so that the
    server's prefix cache does not turn a long-prompt benchmark into a short one."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.num_special = len(tokenizer("a").input_ids) - len(tokenizer("a", add_special_tokens=False).input_ids)
        self.words = [w for w in _WORDS if self._one_token(w) and self._one_token(" " + w)]
        if len(self.words) < 16:
            raise ValueError("the tokenizer splits too many common English words to build prompts from them")

    def _one_token(self, text: str) -> bool:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids) == 1

    def make(self, num_tokens: int) -> str:
        num_words = num_tokens - self.num_special
        if num_words < 1:
            raise ValueError(f"a prompt needs at least {self.num_special + 1} tokens, got {num_tokens}")
        text = " ".join(self.rng.choice(self.words) for _ in range(num_words))
        if len(self.tokenizer(text).input_ids) != num_tokens:
            raise ValueError(f"prompt of {num_tokens} tokens tokenized to another length")
        return text


@dataclass(slots=True)
class Record:
    """One request as the client saw it: when it went out and when each response came back."""

    start: float
    max_tokens: int
    prompt_tokens: int = 0
    # (arrival time, output tokens so far) per streamed response.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0


def level_stats(records: list[Record], window: tuple[float, float], ttft_target: float = float("inf"),
                tpot_target: float = float("inf")) -> dict:
    """Statistics over a measurement window [t0, t1): output tokens and gaps that arrived in it,
    TTFT of requests that started in it, end-to-end latency of requests that finished in it.
    Goodput counts finished requests whose TTFT and mean time per output token (after the
    first) meet the targets."""
    t0, t1 = window
    tokens, ttfts, itls, e2es, finished, good = 0, [], [], [], 0, 0
    for r in records:
        previous = (r.start, 0)
        for when, count in r.chunks:
            if t0 <= when < t1:
                tokens += count - previous[1]
                if previous[1] > 0:
                    itls.append(when - previous[0])
            previous = (when, count)
        if r.chunks and t0 <= r.start < t1:
            ttfts.append(r.chunks[0][0] - r.start)
        if r.end is not None and r.error is None and t0 <= r.end < t1:
            finished += 1
            e2es.append(r.end - r.start)
            ttft = r.chunks[0][0] - r.start
            tpot = (r.end - r.chunks[0][0]) / max(1, r.num_output_tokens - 1)
            good += ttft <= ttft_target and tpot <= tpot_target
    seconds = t1 - t0
    return {"output_tokens_per_s": tokens / seconds, "requests_per_s": finished / seconds,
            "goodput_requests_per_s": good / seconds, "num_finished": finished,
            "num_errors": sum(r.error is not None for r in records),
            "ttft_s": summarize(ttfts), "itl_s": summarize(itls), "e2e_s": summarize(e2es)}


# ---------------------------------------------------------------- talking to the server

@dataclass(slots=True)
class Workload:
    """What to send: a prompt text and max_tokens per request, cycled through."""

    prompts: list[tuple[str, int, int]]  # (text, prompt tokens, max_tokens)

    @classmethod
    def fixed(cls, factory: PromptFactory, num: int, prompt_tokens: int, output_tokens: int) -> "Workload":
        return cls([(factory.make(prompt_tokens), prompt_tokens, output_tokens) for _ in range(num)])

    @classmethod
    def chat(cls, factory: PromptFactory, num: int, seed: int = 0, max_prompt: int = 4000,
             max_output: int = 1000) -> "Workload":
        return cls([(factory.make(max(p, factory.num_special + 1)), max(p, factory.num_special + 1), o)
                    for p, o in chat_lengths(num, seed, max_prompt, max_output)])


def _inputs(grpcaio, text: str, max_tokens: int) -> list:
    # End of sequence ignored, so that every request makes max_tokens tokens; the prompt goes
    # as it is, without the chat template, so that its length is what the workload says.
    return infer_inputs(grpcaio, (("text_input", np.array([[text.encode()]], dtype=object)),
                                  ("max_tokens", np.array([[max_tokens]], dtype=np.int32)),
                                  ("end_id", np.array([[-1]], dtype=np.int32)),
                                  ("stream", np.array([[True]])),
                                  ("apply_chat_template", np.array([[False]]))))


async def _one(client, grpcaio, model: str, text: str, prompt_tokens: int, max_tokens: int,
               records: list[Record]) -> None:
    record = Record(start=time.perf_counter(), max_tokens=max_tokens, prompt_tokens=prompt_tokens)
    records.append(record)

    async def requests():
        yield {"model_name": model, "inputs": _inputs(grpcaio, text, max_tokens)}

    stream = client.stream_infer(requests())
    try:
        async for result, error in stream:
            now = time.perf_counter()
            if error is not None:
                record.error, record.end = str(error), now
                return
            record.chunks.append((now, int(result.as_numpy("num_output_tokens").reshape(-1)[0])))
            if result.as_numpy("finish_reason") is not None:  # the final response's
                # Read on until the server ends the stream: leaving it at the last response
                # cancels the call, and may do so before the ensemble has closed the request.
                record.end = now
    finally:
        if record.end is None:  # cancelled after the drain timeout: the server aborts it
            stream.cancel()


async def run_load(url: str, model: str, workload: Workload, duration: float, warmup: float = 0.0,
                   concurrency: int | None = None, rate: float | None = None, seed: int = 0,
                   progress: bool = True, drain_timeout: float = 120.0) -> tuple[list[Record], tuple[float, float]]:
    """Sends the workload for warm-up + duration seconds, closed loop at `concurrency` or open
    loop at `rate` requests/s (at most `concurrency` in flight when both are given), then waits
    for the requests in flight (cancelled after `drain_timeout`). Returns the records and the
    measurement window."""
    import tritonclient.grpc.aio as grpcaio
    from tqdm import tqdm

    if concurrency is None and rate is None:
        raise ValueError("give a concurrency, an arrival rate, or both")
    client = grpcaio.InferenceServerClient(url)
    records: list[Record] = []
    order = iter(range(1 << 62))
    start = time.perf_counter()
    stop_at = start + warmup + duration
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=round(warmup + duration), desc=f"{model} " + (f"rate {rate}/s" if rate else f"c={concurrency}"),
               unit="s", leave=False, disable=not progress)

    async def send_next():
        text, prompt_tokens, max_tokens = workload.prompts[next(order) % len(workload.prompts)]
        await _one(client, grpcaio, model, text, prompt_tokens, max_tokens, records)

    async def closed_loop_worker():
        while time.perf_counter() < stop_at:
            await send_next()

    async def open_loop():
        tasks = []
        for at in poisson_arrivals(rate, warmup + duration, seed):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(_limited(limit, send_next)))
        await asyncio.gather(*tasks)

    async def ticker():
        while time.perf_counter() < stop_at:
            await asyncio.sleep(1.0)
            bar.update(1)

    work = asyncio.ensure_future(open_loop() if rate else
                                 asyncio.gather(*(closed_loop_worker() for _ in range(concurrency))))
    tick = asyncio.ensure_future(ticker())
    # Requests in flight when the window closes run to their end: cancelling them would be
    # faster, but a stream cancelled by the client leaves Triton's ensemble scheduler counting
    # it as in flight (the server then waits for it at exit), which would skew later levels.
    try:
        await asyncio.wait_for(work, timeout=max(0.0, stop_at - time.perf_counter()) + drain_timeout)
    except asyncio.TimeoutError:
        pass
    tick.cancel()
    bar.close()
    await client.close()
    return records, (start + warmup, stop_at)


async def _limited(limit, make):
    if limit is None:
        return await make()
    async with limit:
        return await make()


class ServerMetrics:
    """The engine's counters from the server's Prometheus endpoint (any model label)."""

    def __init__(self, metrics_url: str):
        self.url = metrics_url

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        with urllib.request.urlopen(self.url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("tritone_"):
                    name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                    values[name] = values.get(name, 0.0) + value
                    if (phase := re.search(r'phase="(\w+)"', line)) is not None:
                        values[f"{name}:{phase.group(1)}"] = values.get(f"{name}:{phase.group(1)}", 0.0) + value
        return values

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine has no request running or waiting, and has reported it (metrics are
        reported once a second)."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while time.monotonic() < deadline:
            m = self.read()
            if m.get("tritone_num_requests_running", 0) == 0 and m.get("tritone_num_requests_waiting", 0) == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.2:
                    return
            else:
                idle_since = None
            time.sleep(0.2)
        raise TimeoutError(f"the engine was still busy {timeout:.0f} s after the load stopped")


STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update", "send")


def step_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per engine step in each phase between two reads of ServerMetrics (send runs
    on the sender thread, beside the next step), and the steps counted."""
    steps = after.get("tritone_steps_total", 0.0) - before.get("tritone_steps_total", 0.0)
    key = "tritone_step_phase_seconds_total:"
    out = {phase: 1000 * (after.get(key + phase, 0.0) - before.get(key + phase, 0.0)) / max(steps, 1.0)
           for phase in STEP_PHASES}
    out["steps"] = steps
    return out


def format_breakdown(breakdown: dict[str, float]) -> str:
    return ", ".join(f"{phase} {breakdown[phase]:.2f}" for phase in STEP_PHASES) + " ms per step"


def measure_level(url: str, model: str, workload: Workload, duration: float, warmup: float,
                  concurrency: int | None = None, rate: float | None = None, metrics: ServerMetrics | None = None,
                  ttft_target: float = float("inf"), tpot_target: float = float("inf"), seed: int = 0,
                  progress: bool = True) -> dict:
    """One level: load, statistics, and the forward-busy fraction over the whole load period,
    warm-up and drain included (the engine is idle before and after, so its forward-seconds
    counter grows only within it)."""
    if metrics:
        metrics.wait_idle()
        before, t_before = metrics.read(), time.perf_counter()
    records, window = asyncio.run(run_load(url, model, workload, duration, warmup, concurrency, rate, seed, progress))
    stats = level_stats(records, window, ttft_target, tpot_target)
    stats.update(concurrency=concurrency, rate=rate, window_s=window[1] - window[0])
    if metrics:
        load_seconds = time.perf_counter() - t_before
        metrics.wait_idle()
        after = metrics.read()
        busy = after.get("tritone_forward_seconds_total", 0.0) - before.get("tritone_forward_seconds_total", 0.0)
        stats["forward_busy"] = min(1.0, busy / load_seconds)
        stats["step_ms"] = step_breakdown(before, after)
    return stats


# ---------------------------------------------------------------- reports

TABLE_HEADER = ("| configuration | conc. | output tok/s | req/s | goodput req/s | TTFT p50 / p99 (s) "
                "| ITL p50 / p99 (ms) | E2E p50 / p99 (s) | forward-busy |\n|---|---|---|---|---|---|---|---|---|")


def tokens_per_s(value: float) -> str:
    """A throughput to print: whole tokens, or one decimal below 10 (a long prompt on a CPU)."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def table_row(label: str, s: dict) -> str:
    load = s["concurrency"] if s.get("rate") is None else f"{s['rate']}/s"
    busy = f"{s['forward_busy']:.2f}" if "forward_busy" in s else ""
    t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
    return (f"| {label} | {load} | {tokens_per_s(s['output_tokens_per_s'])} | {s['requests_per_s']:.2f} "
            f"| {s['goodput_requests_per_s']:.2f} | {t['p50']:.3f} / {t['p99']:.3f} "
            f"| {1000 * i['p50']:.1f} / {1000 * i['p99']:.1f} | {e['p50']:.2f} / {e['p99']:.2f} | {busy} |")


def markdown_table(rows: list[tuple[str, dict]]) -> str:
    return "\n".join([TABLE_HEADER] + [table_row(label, s) for label, s in rows])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritone-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of the server (default 127.0.0.1:8001)")
    p.add_argument("--metrics-url", help="the server's metrics endpoint, for the forward-busy fraction "
                                         "(e.g. http://127.0.0.1:8002/metrics)")
    p.add_argument("--model", default="ensemble", help="model to call: ensemble (default) or llm_inline")
    p.add_argument("--tokenizer", help="tokenizer directory for exact prompt lengths (default: the default model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[], help="closed-loop levels, e.g. 1 4 16")
    p.add_argument("--rate", type=float, nargs="+", default=[], help="open-loop levels: Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight at an arrival rate")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--mix", choices=["fixed", "chat"], default="fixed",
                   help="fixed: every request the same lengths; chat: a long-tailed mix of lengths")
    p.add_argument("--duration", type=float, default=10.0, help="measurement window per level, seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window opens")
    p.add_argument("--ttft-target", type=float, default=2.0, help="goodput: time to first token at most this (s)")
    p.add_argument("--tpot-target", type=float, default=0.2,
                   help="goodput: mean time per output token at most this (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the table here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.concurrency and not args.rate:
        args.concurrency = [1]
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from tritone.models import prepare_default_model

        args.tokenizer = str(prepare_default_model())
    factory = PromptFactory(AutoTokenizer.from_pretrained(args.tokenizer), args.seed)
    num = 2 * max(args.concurrency + [args.max_concurrency or 0, 64])
    workload = (Workload.chat(factory, num, args.seed) if args.mix == "chat"
                else Workload.fixed(factory, num, args.prompt_tokens, args.output_tokens))
    metrics = ServerMetrics(args.metrics_url) if args.metrics_url else None
    levels = [(c, None) for c in args.concurrency] + [(args.max_concurrency, r) for r in args.rate]
    rows = []
    for concurrency, rate in levels:
        stats = measure_level(args.url, args.model, workload, args.duration, args.warmup, concurrency, rate,
                              metrics, args.ttft_target, args.tpot_target, args.seed)
        rows.append((args.model, stats))
        print(table_row(args.model, stats) if len(rows) > 1 else markdown_table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "levels": [s for _, s in rows]}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
