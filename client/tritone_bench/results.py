"""Result files: a benchmark's figures with the machine, commit and date they came from.

Every benchmark writes one JSON file; without a path, under bench_results/runs/ (kept out of
git), named after the benchmark, the machine kind and the time. The files the docs render from
are chosen runs copied to bench_results/ under a stable name.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess

from tritone_bench.machine import kind, machine

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ROOT / "bench_results" / "runs"


def commit() -> str | None:
    """The checkout's commit, with `-dirty` where files differ from it (the figures then come
    from code no commit holds); None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def provenance() -> dict:
    """Machine, commit and date of a run made now."""
    return {"machine": machine(), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save(name: str, results: dict, path: str | pathlib.Path | None = None) -> pathlib.Path:
    """Adds their provenance (machine, commit, date) to `results` where they lack it, and writes
    them to `path`, or to a new file under bench_results/runs/; returns the path."""
    for key, value in provenance().items():
        results.setdefault(key, value)
    if path is None:
        stamp = results["date"].replace(":", "").replace("-", "")[:15]
        path = RUNS / f"{name}-{kind(results['machine'])}-{stamp}.json"
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
