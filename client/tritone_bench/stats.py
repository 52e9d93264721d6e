"""What a user sees of streamed requests: the one definition of TTFT and ITL every benchmark uses.

TTFT is the time from sending a request to the first response that carries a token. A later
response that carries k tokens after a gap of g seconds counts as k inter-token gaps of g/k (the
server's own count says how many tokens each response carries: Tritone's num_output_tokens,
the OpenAI stream's continuous usage), so a server that bundles tokens under load is measured
per token like one that streams each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def percentile(values, q: float) -> float:
    """The q-th percentile (linear interpolation), NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(values) -> dict[str, float]:
    """Mean, median, p90 and p99 (NaN for no values)."""
    values = list(values)
    return {"mean": float(np.mean(values)) if values else float("nan"), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


@dataclass(slots=True)
class Record:
    """One request as the client saw it: when it went out and when each token-carrying response came back."""

    start: float
    max_tokens: int
    prompt_tokens: int = 0
    # (arrival time, output tokens so far) per response that carried tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None
    error: str | None = None

    def add(self, when: float, num_tokens: int) -> None:
        """A response arrived with `num_tokens` output tokens so far; one that carries none is not a chunk."""
        if num_tokens > self.num_output_tokens:
            self.chunks.append((when, num_tokens))

    @property
    def num_output_tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start if self.chunks else float("nan")


def level_stats(records: list[Record], window: tuple[float, float], ttft_target: float = float("inf"),
                tpot_target: float = float("inf")) -> dict:
    """Statistics over a measurement window [t0, t1): output tokens and gaps that arrived in it,
    TTFT of requests that started in it, end-to-end latency of requests that finished in it.
    Goodput counts finished requests whose TTFT and mean time per output token (after the
    first) meet the targets."""
    t0, t1 = window
    tokens, responses, ttfts, itls, e2es, finished, good = 0, 0, [], [], [], 0, 0
    for r in records:
        previous = (r.start, 0)
        for when, count in r.chunks:
            if t0 <= when < t1:
                tokens += count - previous[1]
                responses += 1
                if previous[1] > 0:
                    itls += [(when - previous[0]) / (count - previous[1])] * (count - previous[1])
            previous = (when, count)
        if r.chunks and t0 <= r.start < t1:
            ttfts.append(r.ttft)
        if r.end is not None and r.error is None and t0 <= r.end < t1:
            finished += 1
            e2es.append(r.end - r.start)
            tpot = (r.end - r.chunks[0][0]) / max(1, r.num_output_tokens - 1) if r.chunks else float("inf")
            good += r.ttft <= ttft_target and tpot <= tpot_target
    seconds = t1 - t0
    return {"output_tokens_per_s": tokens / seconds, "requests_per_s": finished / seconds,
            "goodput_requests_per_s": good / seconds, "num_finished": finished, "num_output_tokens": tokens,
            "num_errors": sum(r.error is not None for r in records),
            "errors": sorted({r.error for r in records if r.error is not None})[:5],
            "tokens_per_response": tokens / max(1, responses), "window_s": seconds,
            "ttft_s": summarize(ttfts), "itl_s": summarize(itls), "e2e_s": summarize(e2es)}


def tokens_per_s(value: float) -> str:
    """A throughput to print: whole tokens, or one decimal below 10 (a long prompt on a CPU)."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"
