"""The machine a benchmark ran on, recorded beside its figures, and the kind it is for the report."""

from __future__ import annotations

import os
import platform
import re

# The vector extensions that decide which kernels and dtype the stacks run.
_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo() -> tuple[dict[str, str], set[str]]:
    fields, flags = {}, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return fields, flags


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return round(kib / 2**20, 1)
    except (OSError, StopIteration):
        return None


def machine() -> dict:
    """Cores, memory, CPU name, family and model, and the vector extensions that decide the kernels."""
    fields, flags = _cpuinfo()
    cpu = re.sub(r"\s+", " ", fields.get("model name", platform.processor()))
    return {"cores": os.cpu_count(), "memory_gib": _memory_gib(), "cpu": cpu, "family": fields.get("cpu family"),
            "model": fields.get("model"), "isa": [name for name in _ISA if name in flags]}


def describe(m: dict) -> str:
    """`2-core AMD EPYC (family 23 model 49; avx2), 8 GiB`; what was not recorded says so."""
    where = f"family {m['family']} model {m['model']}; " if m.get("family") else "family and model unknown; "
    isa = m.get("isa")
    isa = "vector extensions unknown" if isa is None else ", ".join(isa or ["no AVX2"])
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ", memory unknown"
    return f"{m['cores']}-core {m['cpu']} ({where}{isa}){memory}"


def kind(m: dict) -> str:
    """The kind of machine, as the report groups results: the vector extensions decide the dtype
    and kernels, so figures compare only within a kind."""
    isa = m.get("isa")
    if isa is None:
        return "unknown"
    if "amx_bf16" in isa:
        return "amx"
    if "avx512_bf16" in isa:
        return "avx512-bf16"
    return "avx2" if "avx2" in isa else "no-avx2"
