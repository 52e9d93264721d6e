"""Linear layers on the GEMM that measured fastest here, for one row and for several.

On CPU, torch's `mm` calls MKL, which is fastest for a single row (a GEMV) but on some CPUs
(measured: AMD EPYC without AVX-512) runs two to sixty-four rows 2x to 2.5x slower than oneDNN
on weights prepacked for it. Each weight shape is timed both ways at start, for one row and for
a decode batch, and the faster is kept for each; the answer is cached with the other hardware
facts. Packed weights live in a table that the `tritone::linear` op reads through a 0-d index
tensor, so that the op stays opaque to torch.compile and one compiled graph serves every layer.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref

import torch

logger = logging.getLogger(__name__)

# Packed weights by index; the Linear layer that owns one holds it, so that it goes away with
# its model (engines come and go in one process: tests, restarts after a failed start).
_packed: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_next_index = itertools.count()
# Rows from which a GEMM counts as a batch (below: the single-row choice).
_BATCH_ROWS = 16


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A oneDNN-prepacked copy of `weight_t` ([in, out]), registered for the `tritone::linear`
    op, and its 0-d index; the caller keeps the copy alive."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), _BATCH_ROWS)
    index = next(_next_index)
    _packed[index] = packed
    return packed, torch.tensor(index)


@torch.library.custom_op("tritone::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor:
    """x @ weight (+ bias), weight [in, out]; `packed` indexes a prepacked copy, used for
    batches of two or more rows."""
    if x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x, _packed[int(packed)], bias, "none", [], "")
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


@linear.register_fake
def _(x, weight, bias, packed):
    return x.new_empty(x.shape[0], weight.shape[1])


def _time(fn, seconds: float = 0.03) -> float:
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            return best


def measure_packed_faster(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN on packed weights beats torch.mm for a batch of decode rows (False where
    oneDNN cannot pack this dtype on this CPU, such as bf16 without AVX-512)."""
    gen = torch.Generator().manual_seed(0)
    weight_t = torch.randn(in_features, out_features, generator=gen).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), _BATCH_ROWS)
    except RuntimeError:
        return False
    x = torch.randn(_BATCH_ROWS * 2, in_features, generator=gen).to(dtype)
    mkl = _time(lambda: torch.mm(x, weight_t))
    onednn = _time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return onednn < mkl


def choose_packing(shapes: set[tuple[int, int]], dtype: torch.dtype, cache_path) -> dict[tuple[int, int], bool]:
    """For each (in, out) shape, whether to prepack it: measured, cached in `cache_path`, logged."""
    key = str(dtype)
    try:
        cached = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cached = {}
    table = cached.get(key, {})
    measured = False
    for k, n in sorted(shapes):
        name = f"{k}x{n}"
        if name not in table:
            table[name] = measure_packed_faster(k, n, dtype)
            measured = True
    if measured:
        cached[key] = table
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cached))
    choice = {(k, n): bool(table[f"{k}x{n}"]) for k, n in shapes}
    logger.info("GEMM for batches (%s): %s", "measured" if measured else "cached",
                ", ".join(f"{k}x{n} {'oneDNN packed' if v else 'torch.mm'}" for (k, n), v in sorted(choice.items())))
    return choice
