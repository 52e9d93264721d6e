"""Tritone's cache directory: prepared checkpoints, compiled kernels, measurements, run files."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """$TRITONE_CACHE, else ~/.cache/tritone."""
    return pathlib.Path(os.environ.get("TRITONE_CACHE", pathlib.Path.home() / ".cache" / "tritone"))
