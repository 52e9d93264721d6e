"""Hardware facts the executor needs, measured rather than guessed from flags: which device,
and which dtype runs this machine's matrix products faster. A measurement takes a fraction of a
second; its answer is cached per CPU, torch version and thread count, and logged. A measurement
taken while other processes held the CPU (a server's first start, where the other models import
their libraries on the same cores) is taken again, and never cached if it stays contended."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import time
from typing import Callable, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")
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
    from tritone.cache import cache_root

    return cache_root() / "hardware" / f"{name}-{_cpu_key()}.json"


def read_facts(path: pathlib.Path) -> dict:
    """A facts file's contents; empty where it is missing or unreadable (then measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_facts(path: pathlib.Path, facts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(facts, indent=1))


# Others' share of the machine's CPU over a measurement above which it is not trusted: a server's
# own idle processes and the kernel stay well under it, a neighbour importing torch is far above.
CONTENDED_SHARE = 0.15


def _machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has run (all CPUs, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def others_share(measure: Callable[[], T]) -> tuple[T, float]:
    """`measure()`, and the share of the machine's CPU that other processes took meanwhile."""
    try:
        busy0, own0, t0 = _machine_busy_seconds(), time.process_time(), time.perf_counter()
    except (OSError, ValueError, IndexError):  # no /proc: nothing to tell
        return measure(), 0.0
    result = measure()
    wall = time.perf_counter() - t0
    others = (_machine_busy_seconds() - busy0) - (time.process_time() - own0)
    return result, max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9)


_patience_ends: float | None = None


@contextlib.contextmanager
def _one_measurer():
    """Held while measuring: one process of the machine at a time (the ranks of a model, or the
    engines of a server, start together and would otherwise measure each other)."""
    from tritone.cache import cache_root

    path = cache_root() / "hardware" / ".measuring.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def uncontended(measure: Callable[[], T], what: str, attempts: int = 3, patience_s: float = 30.0) -> tuple[T, bool]:
    """`measure()` taken while other processes leave the CPU alone, and whether it was. Before each
    of `attempts` tries it waits, up to `patience_s` in all, for a quiet moment; a contended answer
    serves this run, but the caller must not cache it."""
    with _one_measurer():
        return _uncontended(measure, what, attempts, patience_s)


def _uncontended(measure: Callable[[], T], what: str, attempts: int, patience_s: float) -> tuple[T, bool]:
    global _patience_ends
    now = time.perf_counter()
    if _patience_ends is None:  # one patience per process, shared by all its measurements
        _patience_ends = now + patience_s
    deadline = min(_patience_ends, now + patience_s)
    for attempt in range(attempts):
        while time.perf_counter() < deadline and others_share(lambda: time.sleep(0.25))[1] > CONTENDED_SHARE:
            pass
        result, share = others_share(measure)
        if share <= CONTENDED_SHARE:
            return result, True
        logger.info("%s measured while other processes took %.0f%% of the CPU%s", what, 100 * share,
                    "; measuring again" if attempt + 1 < attempts else ": used for this run, not cached")
    return result, False


def fastest_cpu_dtype() -> torch.dtype:
    path = facts_path("cpu")
    facts, source = read_facts(path), "cached"
    if "gemm_gflops" not in facts:
        gflops, quiet = uncontended(lambda: {name: measure_gemm_gflops(DTYPES[name]) for name in ("float32", "bfloat16")},
                                    "GEMM throughput per dtype")
        facts = {"gemm_gflops": gflops}
        if quiet:
            write_facts(path, facts)
        source = "measured" if quiet else "measured under contention, not cached"
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
