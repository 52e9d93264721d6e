"""Linear layers on the GEMM that measured fastest here, per weight shape, for one row and for a
batch of rows.

The candidates on CPU: torch's `mm` (MKL), oneDNN on a prepacked copy, and Tritone's own kernel
(`csrc/gemm.c`: fp32, or bf16 on CPUs with AVX512-BF16) on a copy packed in column panels, which
prefetches the weights it is about to read. Which wins depends on the CPU: measured on a 2-core
AMD EPYC (AVX2, two threads, weights streamed from memory), Tritone's fp32 kernel ran 1.3x
oneDNN at 32 and 128 rows and 1.3x to 2x MKL's GEMV at one row. Each weight shape is timed every way at start, on copies of the weight
that together overflow the last-level cache (a forward pass reads each weight once, so a
measurement on a weight already in cache would favour the wrong kernel); the answers are cached
with the other hardware facts and logged.

A layer's packed copies live in a table that the `tritone::linear` op reads through a 0-d
index tensor, so that the op stays opaque to torch.compile and one compiled graph serves every
layer.
"""

from __future__ import annotations

import itertools
import json
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
KERNELS = ("mm", "onednn", "tritone")


@dataclass(eq=False)
class PackedLinear:
    """A layer's weight in the layouts its chosen kernels read, and the choice for one row and
    for batches."""

    weight: torch.Tensor  # [in, out], for torch.mm
    single: str
    batch: str
    onednn: torch.Tensor | None = field(default=None, init=False)
    panels: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self):
        kernels_used = {self.single, self.batch}
        if "onednn" in kernels_used:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.t().contiguous(), _BATCH_ROWS)
        if "tritone" in kernels_used:
            self.panels = kernels.pack(self.weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.single if x.shape[0] == 1 else self.batch
        if kernel == "tritone":
            if x.dtype == torch.bfloat16:
                out = kernels.gemm_bf16(x, self.panels, None, self.weight.shape[1])
                return (out if bias is None else out + bias).to(x.dtype)
            return kernels.gemm_f32(x, self.panels, bias, self.weight.shape[1])
        if kernel == "onednn":
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
    return tuple(names)


def pack(weight_t: torch.Tensor, single: str, batch: str) -> tuple[PackedLinear, torch.Tensor]:
    """`weight_t` ([in, out]) made ready for `single` (one row) and `batch` kernels, registered
    for the `tritone::linear` op, and its 0-d index; the caller keeps the first alive."""
    layer = PackedLinear(weight_t, single, batch)
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


def measure(in_features: int, out_features: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Seconds per call of each available kernel at one row and at a batch of rows, on weights
    streamed from memory; a kernel that cannot take this dtype here is left out."""
    gen = torch.Generator().manual_seed(0)
    num_copies = max(1, -(-_COLD_BYTES // (in_features * out_features * dtype.itemsize)))
    weights = [torch.randn(in_features, out_features, generator=gen).to(dtype) for _ in range(num_copies)]
    times = {}
    for kernel in available(dtype):
        try:
            copies = [PackedLinear(w, kernel, kernel) for w in weights]
            times[kernel] = {}
            for rows in (1, _BATCH_ROWS):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                times[kernel][str(rows)] = _time_cold(lambda layer: layer(x, None), copies)
        except RuntimeError:
            times.pop(kernel, None)
    return times


def choose(shapes: set[tuple[int, int]], dtype: torch.dtype, cache_path) -> dict[tuple[int, int], tuple[str, str]]:
    """For each (in, out) shape, the fastest kernel for one row and for a batch: measured,
    cached in `cache_path`, logged."""
    key = f"{dtype} {'/'.join(available(dtype))}"  # a kernel added here is measured, not left out
    try:
        cached = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cached = {}
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
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cached, indent=1))
    choice = {}
    for k, n in shapes:
        times = table[f"{k}x{n}"]
        choice[(k, n)] = tuple(min(times, key=lambda kernel: times[kernel][rows]) for rows in ("1", str(_BATCH_ROWS)))
    logger.info("GEMMs (%s; one row / %d rows): %s",
                "measured, partly under contention (not cached)" if contended else "measured" if measured else "cached",
                _BATCH_ROWS,
                ", ".join(f"{k}x{n} {single}/{batch} "
                          f"({_gflops(k, n, 1, table[f'{k}x{n}'][single]['1'])}/"
                          f"{_gflops(k, n, _BATCH_ROWS, table[f'{k}x{n}'][batch][str(_BATCH_ROWS)])} GFLOP/s)"
                          for (k, n), (single, batch) in sorted(choice.items())))
    return choice


def _gflops(k: int, n: int, rows: int, seconds: float) -> str:
    return f"{2 * k * n * rows / seconds / 1e9:.0f}"
