"""Linear layers on the GEMM kernel that measured fastest here and passed its checks, one kernel per
weight shape for every row count.

One kernel for every row count, and each candidate checked to be row-invariant, because a seed must
mean one text (docs/contract.md): a row's product may not depend on how many rows share the call or
where the row sits. MKL's `mm` and oneDNN's prepacked GEMM pick their blocking by the row count, so
their results change with it (measured on an Intel Xeon with AMX: row 0 of a 33-row bf16 call differs
from the same row alone); called on blocks of `block_rows` rows (the last one padded where the
kernel needs it), they give each row the same bits whatever else is in the batch. Tritone's own kernel (`csrc/gemm.c`: fp32,
or bf16 on CPUs with AVX512-BF16, on a copy packed in column panels; "amx", the same panels on AMX
tiles where the CPU has them) computes each row alike at any row count. Each candidate is checked at start on this machine, against the product in float32 and
for row invariance, before it is timed; one that fails is dropped and logged.

Which is fastest depends on the CPU: on a 2-core AMD EPYC (AVX2, fp32) Tritone's kernel ran 1.3x
oneDNN at 32 rows; on an Intel Xeon with AMX, oneDNN's bf16 GEMM on blocks of 32 rows ran 3-5x
Tritone's. Each shape is timed at one row and at 32 rows on copies of the weight that together
overflow the last-level cache (a forward pass reads each weight once, so a measurement on a weight
already in cache would favour the wrong kernel); the kernel with the least time for the two serves.
The answers and the checks' verdicts are cached with the other hardware facts and logged.

A layer's packed copies live in a table that the `tritone::linear` op reads through a 0-d
index tensor, so that the op stays opaque to torch.compile and one compiled graph serves every
layer.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from tritone.executor import hardware, kernels

logger = logging.getLogger(__name__)

# Rows of the measured batch: a moderate decode batch, where serving spends its time.
_BATCH_ROWS = 32
# The measurement's copies of a weight span at least this much memory, beyond any CPU's L3 here.
_COLD_BYTES = 64 << 20
# ...but never more copies than this: a weight so small that it takes more is one of a model whose
# weights all fit in cache, so timing it from cache is what serving will see, and packing thousands
# of copies for every candidate took minutes at start.
_MAX_COPIES = 64
# Torch's kernels run on blocks of this many rows, the last one padded ("/32p") or not ("/32"): on
# an Intel Xeon with AMX oneDNN's bf16 GEMM gives a row the same bits at any row count up to 32
# (not past it), so its last block needs no padding and a lone decode row costs one row's GEMM;
# MKL's changes below 32 rows too. The check at start decides which hold here.
_BLOCK_ROWS = 32
KERNELS = ("mm", "onednn", "tritone", "amx")
# A kernel's largest error against the float32 product of the same rounded operands, relative to
# that product's largest magnitude: fp32 sums in another order, or a bf16 output's rounding.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def candidate_names(kernel: str) -> list[str]:
    """`kernel` as the choices it is measured in: Tritone's as it is, torch's on blocks of rows."""
    return [kernel] if kernel in ("tritone", "amx") else [f"{kernel}/{_BLOCK_ROWS}", f"{kernel}/{_BLOCK_ROWS}p"]


@dataclass(eq=False)
class PackedLinear:
    """A layer's weight in the layout its kernel reads. `choice` is "tritone", "amx" (Tritone's bf16
    GEMM on AMX tiles, same panels), or "mm/R" or
    "onednn/R": torch's kernel on blocks of R rows, the last one as it is, or with "p" after R,
    padded to R rows."""

    weight: torch.Tensor  # [in, out], for torch.mm
    choice: str
    kernel: str = field(init=False)
    block_rows: int = field(init=False)
    padded: bool = field(init=False)
    onednn: torch.Tensor | None = field(default=None, init=False)
    panels: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self):
        self.kernel, _, rows = self.choice.partition("/")
        self.padded = rows.endswith("p")
        self.block_rows = int(rows.removesuffix("p") or 0)
        if self.kernel == "onednn":
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.t().contiguous(), self.block_rows)
        elif self.kernel in ("tritone", "amx"):
            self.panels = kernels.pack(self.weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "amx":
            out = kernels.gemm_bf16_amx(x, self.panels, None, self.weight.shape[1])
            return (out if bias is None else out + bias).to(x.dtype)
        if self.kernel == "tritone":
            if x.dtype == torch.bfloat16:
                out = kernels.gemm_bf16(x, self.panels, None, self.weight.shape[1])
                return (out if bias is None else out + bias).to(x.dtype)
            return kernels.gemm_f32(x, self.panels, bias, self.weight.shape[1])
        rows = self.block_rows
        if rows == 0:  # no row-invariant kernel passed here (logged at start)
            return self._block(x, bias)
        n = x.shape[0]
        if self.padded and n % rows:
            x = torch.cat([x, x.new_zeros(rows - n % rows, x.shape[1])])
        if x.shape[0] <= rows:
            return self._block(x, bias)[:n]
        return torch.cat([self._block(x[i:i + rows], bias) for i in range(0, x.shape[0], rows)])[:n]

    def _block(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        return torch.mm(x, self.weight) if bias is None else torch.addmm(bias, x, self.weight)


# Packed layers by index; the Linear layer that owns one holds it, so that it goes away with
# its model (engines come and go in one process: tests, restarts after a failed start).
_packed: "weakref.WeakValueDictionary[int, PackedLinear]" = weakref.WeakValueDictionary()
_next_index = itertools.count()


def available(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels that can run `dtype` on this machine (oneDNN's prepacking is checked by
    the measurement itself: bf16 fails on CPUs without AVX-512)."""
    names = ["mm"]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        names.append("onednn")
    if (dtype == torch.float32 and kernels.native_library() is not None) or (
            dtype == torch.bfloat16 and kernels.bf16_gemm_supported()):
        names.append("tritone")
    if dtype == torch.bfloat16 and kernels.amx_gemm_supported():
        names.append("amx")
    return tuple(names)


def pack(weight_t: torch.Tensor, choice: str) -> tuple[PackedLinear, torch.Tensor]:
    """`weight_t` ([in, out]) made ready for the kernel `choice`, registered for the
    `tritone::linear` op, and its 0-d index; the caller keeps the first alive."""
    layer = PackedLinear(weight_t, choice)
    index = next(_next_index)
    _packed[index] = layer
    return layer, torch.tensor(index)


@torch.library.custom_op("tritone::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor:
    """x @ weight (+ bias), weight [in, out], on the kernels the layer indexed by `packed` chose."""
    return _packed[int(packed)](x, bias)


@linear.register_fake
def _(x, weight, bias, packed):
    return x.new_empty(x.shape[0], weight.shape[1])


def _time_cold(fn, copies: list, rounds: int = 3) -> float:
    """Seconds per call, the best of `rounds` passes over every copy."""
    for c in copies[:2]:
        fn(c)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def check(layer: PackedLinear, dtype: torch.dtype, gen: torch.Generator) -> str | None:
    """Why `layer`'s kernel may not serve here (None: it may): its product strays from the float32
    product of the same rounded operands, or a row's result changes with the rows beside it."""
    k = layer.weight.shape[0]
    x = torch.randn(40, k, generator=gen).to(dtype)
    want = x.float() @ layer.weight.float()
    got = layer(x, None)
    error = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not error <= _TOLERANCE[dtype]:
        return f"wrong: off the float32 product by {error:.2g} of its largest value (tolerance {_TOLERANCE[dtype]:g})"
    for first, last in ((0, 1), (0, 2), (5, 20), (0, 31), (0, 33), (7, 40), (39, 40)):
        if not torch.equal(layer(x[first:last].contiguous(), None), got[first:last]):
            return f"row-variant: rows {first}..{last - 1} alone differ from the same rows in a 40-row call"
    return None


def measure(in_features: int, out_features: int, dtype: torch.dtype) -> dict[str, dict]:
    """Per candidate kernel (`candidate_names`): seconds per call at one row and at a batch of rows,
    on weights streamed from memory, or why it was dropped (`check`); a kernel that cannot take
    this dtype here is left out."""
    gen = torch.Generator().manual_seed(0)
    num_copies = min(_MAX_COPIES, max(1, -(-_COLD_BYTES // (in_features * out_features * dtype.itemsize))))
    weights = [torch.randn(in_features, out_features, generator=gen).to(dtype) for _ in range(num_copies)]
    results = {}
    for name in (c for kernel in available(dtype) for c in candidate_names(kernel)):
        try:
            copies = [PackedLinear(w, name) for w in weights]
            reason = check(copies[0], dtype, gen)
        except RuntimeError:
            continue
        if reason is not None:
            results[name] = {"dropped": reason}
            continue
        results[name] = {}
        for rows in (1, _BATCH_ROWS):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            results[name][str(rows)] = _time_cold(lambda layer: layer(x, None), copies)
    return results


def _cost(times: dict) -> float:
    """A lone decode's time plus a batch's: one kernel serves both."""
    return times["1"] + times[str(_BATCH_ROWS)]


def choose(shapes: set[tuple[int, int]], dtype: torch.dtype, cache_path, only: str | None = None
           ) -> dict[tuple[int, int], str]:
    """For each (in, out) shape, the fastest kernel that passed its checks: measured, cached in
    `cache_path`, logged (with every candidate dropped and why). `only`: the one kernel asked for
    (--gemm), which must run and pass its checks here for every shape, or the start is refused."""
    if only is not None:
        return _only(shapes, dtype, only)
    # The checks' version and the candidates: a kernel added here is measured, not left out.
    key = f"{dtype} checked-v2 {'/'.join(available(dtype))}"
    cached = hardware.read_facts(cache_path)
    table = dict(cached.get(key, {}))
    measured = contended = False
    for k, n in sorted(shapes):
        name = f"{k}x{n}"
        if name not in table:
            table[name], quiet = hardware.uncontended(lambda: measure(k, n, dtype), f"GEMM {name} ({dtype})")
            measured = True
            if quiet:  # only what was measured on a quiet machine sticks
                cached.setdefault(key, {})[name] = table[name]
            contended |= not quiet
    if measured:
        hardware.write_facts(cache_path, cached)
    choice, dropped = {}, []
    for k, n in shapes:
        results = table[f"{k}x{n}"]
        passed = {c: t for c, t in results.items() if "dropped" not in t}
        dropped += [f"{c} for {k}x{n} ({t['dropped']})" for c, t in sorted(results.items()) if "dropped" in t]
        if passed:
            choice[(k, n)] = min(passed, key=lambda c: _cost(passed[c]))
        else:  # nothing row-invariant runs here: torch's mm serves, and seeds may part (logged)
            choice[(k, n)] = "mm"
            logger.warning("GEMM %dx%d: no kernel passed its checks here; torch.mm serves, whose results change "
                           "with the batch's row count", k, n)
    for reason in dropped:
        logger.warning("GEMM kernel dropped: %s", reason)
    logger.info("GEMMs (%s; GFLOP/s at one row / %d rows): %s",
                "measured, partly under contention (not cached)" if contended else "measured" if measured else "cached",
                _BATCH_ROWS,
                ", ".join(f"{k}x{n} {c}" + (f" ({_gflops(k, n, 1, t['1'])}/{_gflops(k, n, _BATCH_ROWS, t[str(_BATCH_ROWS)])})"
                                            if (t := table[f"{k}x{n}"].get(c)) else "")
                          for (k, n), c in sorted(choice.items())))
    return choice


def _only(shapes: set[tuple[int, int]], dtype: torch.dtype, kernel: str) -> dict[tuple[int, int], str]:
    """Kernel `kernel` for every shape (its first candidate that passes the checks), or ValueError
    naming --gemm."""
    if kernel not in available(dtype):
        raise ValueError(f"--gemm {kernel}: does not run {str(dtype).removeprefix('torch.')} here (this machine "
                         f"runs: {', '.join(available(dtype))})")
    gen, choice = torch.Generator().manual_seed(0), {}
    for k, n in sorted(shapes):
        weight = torch.randn(k, n, generator=gen).to(dtype)
        reasons = {}
        for name in candidate_names(kernel):
            reasons[name] = check(PackedLinear(weight, name), dtype, gen)
            if reasons[name] is None:
                choice[(k, n)] = name
                break
        else:
            raise ValueError(f"--gemm {kernel}: fails its check for {k}x{n} here: "
                             + "; ".join(f"{c}: {r}" for c, r in reasons.items()))
    logger.info("GEMMs: %s for every shape, as asked (--gemm), checked", kernel)
    return choice


def _gflops(k: int, n: int, rows: int, seconds: float) -> str:
    return f"{2 * k * n * rows / seconds / 1e9:.0f}"
