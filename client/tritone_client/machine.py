"""The machine a benchmark ran on, recorded beside its figures."""

from __future__ import annotations

import os
import platform
import re

_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict:
    """Cores, CPU name, family and model, and the vector extensions that decide the kernels."""
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
    cpu = re.sub(r"\s+", " ", fields.get("model name", platform.processor()))
    return {"cores": os.cpu_count(), "cpu": cpu, "family": fields.get("cpu family"), "model": fields.get("model"),
            "isa": [name for name in _ISA if name in flags]}


def describe(m: dict) -> str:
    """`2-core AMD EPYC (family 23 model 49; avx2)`."""
    where = f"family {m['family']} model {m['model']}; " if m.get("family") else ""
    return f"{m['cores']}-core {m['cpu']} ({where}{', '.join(m.get('isa') or ['no AVX2'])})"
