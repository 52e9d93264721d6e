"""Hardware facts the executor needs, measured rather than guessed from flags: which device,
and which dtype runs this machine's matrix products faster. A measurement takes a fraction of a
second; its answer is cached per CPU, torch version and thread count, and logged."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import platform
import time

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# GEMM shapes of a small model's decode step at a moderate batch (rows x in x out): the sizes
# where serving spends its time, not the large squares where every dtype looks good.
_SHAPES = ((32, 576, 1536), (32, 1536, 576), (32, 576, 960))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 (fp16 where bf16 is missing) on CUDA; on CPU, whichever of fp32 and bf16
    measured faster here."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return fastest_cpu_dtype()


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = platform.processor()
    raw = f"{info}|{torch.__version__}|{torch.get_num_threads()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def facts_path(name: str) -> pathlib.Path:
    """Where measured facts named `name` are cached for this CPU, torch version and thread count."""
    from tritone.models import cache_root

    return cache_root() / "hardware" / f"{name}-{_cpu_key()}.json"


def fastest_cpu_dtype() -> torch.dtype:
    path = facts_path("cpu")
    try:
        facts = json.loads(path.read_text())
        source = "cached"
    except (OSError, ValueError):
        facts = {"gemm_gflops": {name: measure_gemm_gflops(DTYPES[name]) for name in ("float32", "bfloat16")}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(facts))
        source = "measured"
    gflops = facts["gemm_gflops"]
    best = max(gflops, key=gflops.get)
    logger.info("CPU dtype %s (%s: GEMM GFLOP/s %s, %d threads)", best, source,
                ", ".join(f"{k} {v:.0f}" for k, v in gflops.items()), torch.get_num_threads())
    return DTYPES[best]


def measure_gemm_gflops(dtype: torch.dtype, seconds: float = 0.15) -> float:
    """Throughput of decode-sized GEMMs in `dtype` on this CPU with torch's current threads: the
    best of a few timed rounds, so that a moment of contention does not decide the answer."""
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype))
             for m, k, n in _SHAPES]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)
    for a, b in pairs:  # first calls pick kernels and fill caches
        torch.mm(a, b)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        for a, b in pairs:
            torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return flops / best / 1e9
