"""Process helpers every part of Tritone shares: a process that dies with its parent, a free port."""

from __future__ import annotations

import ctypes
import os
import signal
import socket

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Asks the kernel to send `sig` to this process when its parent dies (a `preexec_fn`, or the
    first call of a child). With `parent`, also exits at once if that parent died before the
    request took effect (the child has been re-parented)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (another process may still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
