"""A fast path serves only after it agreed with the reference on this machine (DESIGN.md,
invariants 7 and 8).

Speed picks the compiled forward, the native forward and the GEMM kernels; none of that says they
are right where they run (torch.compile's bf16 arithmetic on an Intel Xeon with AMX was not the
eager forward's). So at start each candidate forward runs a probe batch, two steps of the same
requests: three prompts of different lengths (one spanning several of the attention kernel's key
blocks), then their decodes beside a fourth prompt. The reference runs the same steps: the eager
modules in the same dtype, on torch.mm and SDPA. The candidate serves only if every row's logits
lie within the dtype's tolerance of the reference's and its greedy token is the reference's, or
within the tolerance of it (a tie). Then, for seeds, the candidate must give a row the same bits
whatever the step holds: a prompt alone and batched, a decode alone and batched, and a token
computed as a decode or as the last row of its prompt.

Verdicts are cached beside the speed measurements, keyed by the model, the dtype, the kernels
chosen and the executor's source, and logged either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from tritone.executor import hardware
from tritone.executor.step import StepInput

logger = logging.getLogger(__name__)

# How far a path's logits may lie from the reference's in the same dtype: a row's largest deviation
# relative to its largest logit (at least 1), on average over the probe's rows and at most. Two
# bf16 paths that round in different places (the eager modules, the native forward that keeps
# float32 between its GEMMs) part by 0.016-0.019 on average and 0.04-0.075 at most on the default
# model; float32 paths by about 1e-5; a wrong kernel by the whole of the logits.
TOLERANCE = {torch.float32: (5e-4, 5e-3), torch.bfloat16: (0.04, 0.25), torch.float16: (0.04, 0.25)}
_PROMPTS = (40, 20, 70)  # the third spans two of the attention kernel's 64-key blocks
_LATE_PROMPT = 25

Forward = Callable[[StepInput], torch.Tensor]


@dataclass(slots=True)
class Verdict:
    problem: str | None  # None: the path may serve
    deviation: float  # the largest relative logit deviation from the reference
    ties: int  # rows whose greedy token differed from the reference's within the tolerance

    def describe(self) -> str:
        agreed = f"within {self.deviation:.3g} of the reference's logits"
        return (f"passed ({agreed}{f', {self.ties} greedy ties' if self.ties else ''})" if self.problem is None
                else f"dropped: {self.problem}")


class Probe:
    """The probe's two steps over blocks of the runner's still unused KV cache."""

    def __init__(self, vocab_size: int, block_size: int, num_blocks: int, seed: int = 0):
        gen = np.random.default_rng(seed)
        lengths = (*_PROMPTS, _LATE_PROMPT)
        need = lambda lengths: sum(-(-(n + 1) // block_size) for n in lengths)
        while need(lengths) > num_blocks and max(lengths) > 2:  # a small cache: shorter prompts
            lengths = tuple(max(2, n // 2) for n in lengths)
        if need(lengths) > num_blocks:
            raise ValueError(f"the KV cache ({num_blocks} blocks) is too small for the start-up check")
        self.lengths = lengths
        self.block_size = block_size
        self.prompts = [gen.integers(0, vocab_size, n) for n in lengths]
        self.extra = [int(t) for t in gen.integers(0, vocab_size, len(lengths))]
        self.tables, first = [], 0
        for n in lengths:
            count = -(-(n + 1) // block_size)
            self.tables.append(np.arange(first, first + count, dtype=np.int32))
            first += count

    def step(self, parts: list[tuple[int, int, int]]) -> StepInput:
        """Sequences' tokens [start, end) as one step, logits at every row; decodes first."""
        ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for seq, start, end in parts:
            tokens = np.append(self.prompts[seq], self.extra[seq])
            ids.append(tokens[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            slots.append(self.tables[seq][pos // self.block_size].astype(np.int64) * self.block_size
                         + pos % self.block_size)
            query_start.append(query_start[-1] + end - start)
            seq_lens.append(end)
        width = max(len(self.tables[seq]) for seq, _, _ in parts)
        tables = np.zeros((len(parts), width), dtype=np.int32)
        for i, (seq, _, _) in enumerate(parts):
            tables[i, :len(self.tables[seq])] = self.tables[seq]
        num_decodes = next((i for i, (_, s, e) in enumerate(parts) if e - s != 1), len(parts))
        rows = query_start[-1]
        return StepInput(np.concatenate(ids).astype(np.int64), np.concatenate(positions).astype(np.int64),
                         np.concatenate(slots), tables, np.array(query_start, dtype=np.int32),
                         np.array(seq_lens, dtype=np.int32), np.arange(rows), num_decodes)

    def batch_steps(self) -> list[StepInput]:
        *firsts, late = self.lengths
        prompts = [(s, 0, n) for s, n in enumerate(firsts)]
        decodes = [(s, n, n + 1) for s, n in enumerate(firsts)]
        return [self.step(prompts), self.step(decodes + [(len(firsts), 0, late)])]


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> Verdict:
    """`got` against the reference's logits `want`, row by row."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return Verdict(f"logits of shape {tuple(got.shape)}, the reference's {tuple(want.shape)}", float("inf"), 0)
    if not torch.isfinite(got).all():
        return Verdict("logits that are not finite", float("inf"), 0)
    scale = want.abs().amax(-1).clamp_min(1.0)
    rows = (got - want).abs().amax(-1) / scale
    mean, deviation = rows.mean().item(), rows.max().item()
    mean_tolerance, max_tolerance = TOLERANCE[dtype]
    if not (mean <= mean_tolerance and deviation <= max_tolerance):
        return Verdict(f"logits off the reference's by {mean:.3g} on average and {deviation:.3g} at most, of the "
                       f"row's largest (tolerance {mean_tolerance:g} and {max_tolerance:g})", deviation, 0)
    # A greedy token may differ only where the reference's own best two are a near-tie.
    picked, best = got.argmax(-1), want.argmax(-1)
    gap = (want.gather(-1, best[:, None]) - want.gather(-1, picked[:, None]))[:, 0] / scale
    if (gap > max_tolerance).any():
        return Verdict("a greedy token that is not the reference's, nor tied with it", deviation, 0)
    return Verdict(None, deviation, int((picked != best).sum()))


def row_variance(forward: Forward, probe: Probe, batched: list[torch.Tensor]) -> str | None:
    """Why `forward` gives a row different bits with other rows beside it (None: it does not).
    `batched`: its logits of the probe's batch steps, which have just run."""
    a, n = 0, probe.lengths[0]
    if not torch.equal(forward(probe.step([(a, 0, n)])), batched[0][:n]):
        return "a prompt's logits alone differ from the same prompt's in a batch"
    if not torch.equal(forward(probe.step([(a, n, n + 1)])), batched[1][:1]):
        return "a decode's logits alone differ from the same decode's in a batch"
    if not torch.equal(forward(probe.step([(a, 0, n + 1)]))[-1:], batched[1][:1]):
        return "a token's logits as the last row of its prompt differ from its logits as a decode"
    return None


def check(forward: Forward, reference: Forward, probe: Probe, dtype: torch.dtype) -> Verdict:
    """`forward` against `reference` on the probe's steps, then for row invariance."""
    want = [reference(step) for step in probe.batch_steps()]
    try:
        got = [forward(step) for step in probe.batch_steps()]
    except Exception as exc:  # a kernel that cannot run here is dropped like a wrong one
        return Verdict(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300],
                       float("inf"), 0)
    verdict = compare(torch.cat(got), torch.cat(want), dtype)
    if verdict.problem is None:
        verdict.problem = row_variance(forward, probe, got)
    return verdict


def cached_check(name: str, key: dict, run: Callable[[], Verdict]) -> Verdict:
    """`run()`'s verdict on path `name`, from the cache where the same key was checked before."""
    digest = hashlib.sha256(json.dumps({**key, "source": _source_digest()}, sort_keys=True).encode()).hexdigest()[:16]
    path = verdicts_path()
    cached = hardware.read_facts(path)
    entry = cached.get(f"{name} {digest}")
    if entry is not None:
        verdict, source = Verdict(entry["problem"], entry["deviation"], entry["ties"]), "cached"
    else:
        verdict, source = run(), "checked"
        cached[f"{name} {digest}"] = {"problem": verdict.problem, "deviation": verdict.deviation,
                                      "ties": verdict.ties}
        hardware.write_facts(path, cached)
    (logger.info if verdict.problem is None else logger.warning)(
        "fast path %s: %s (%s against the eager reference in the same dtype)", name, verdict.describe(), source)
    return verdict


def verdicts_path() -> pathlib.Path:
    return hardware.facts_path("fast-paths")


def _source_digest() -> str:
    """The executor's code: a change to any kernel or model file checks every path again."""
    root = pathlib.Path(__file__).parent
    files = sorted([*root.glob("*.py"), *(root / "csrc").glob("*")])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files) + torch.__version__.encode()).hexdigest()[:16]
