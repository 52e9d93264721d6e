"""Process helpers every part of Tritone shares: a process that dies with its parent, a free port,
a lower priority for the text work that shares the CPU with the engine."""

from __future__ import annotations

import ctypes
import os
import pathlib
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


def lower_priority(pid: int, nice: int) -> list[int]:
    """Raises the nice value of every thread of process `pid` to at least `nice` (at most 19)
    and returns the threads it changed: Linux schedules threads, and a thread started later
    inherits its creator's, so running it again catches only the new ones that need it. Raising a
    nice value needs no privilege; a thread that has ended or cannot be changed is left."""
    changed = []
    try:
        tids = [int(t.name) for t in pathlib.Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return changed
    for tid in tids:
        try:
            if lower_thread_priority(tid, nice):
                changed.append(tid)
        except OSError:
            continue
    return changed


def lower_thread_priority(tid: int, nice: int) -> bool:
    """Raises thread `tid`'s nice value to `nice` (at most 19) where it is lower; whether it
    changed. OSError where the thread has ended or cannot be changed."""
    nice = min(19, nice)
    if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
        return False
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return True
