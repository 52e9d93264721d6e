"""A model process's life beside tritonserver: ending with its server or its engine, and the
graceful drain the launcher asks for."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Callable

from tritone.config import is_set


# Every `poll` seconds: ends when the process $2 is gone, kills it once its parent is no longer
# $1 (tritonserver died and it was re-parented).
_ORPHAN_WATCH = """
while [ -d /proc/$2 ]; do
  [ "$(cut -d' ' -f4 /proc/$2/stat)" = "$1" ] || { kill -9 $2; exit 0; }
  sleep $3
done
"""


def exit_when_orphaned(poll_seconds: float = 1.0) -> None:
    """Ends this model process as soon as tritonserver, its parent, is gone.

    The Python backend's stub is meant to exit when the server dies, but an engine process has
    been seen to outlive a killed server, keeping its memory and a core. A thread of its own
    is not enough: the stub was found with every thread waiting on a lock, the interpreter's
    lock held by one blocked on the dead server's shared memory. So a small shell process,
    which needs nothing from this one, watches instead."""
    subprocess.Popen(["/bin/sh", "-c", _ORPHAN_WATCH, "tritone-orphan-watch", str(os.getppid()), str(os.getpid()),
                      str(poll_seconds)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)


def end_process(message: str) -> None:
    """The engine died (see tritone.engine.async_engine): ends this model's process, once its
    requests have been failed, so that the launcher restarts the server as for any dead model
    process. A model that stayed up would accept requests it can never answer, and Triton 2.51's
    Python backend has no way to report one model instance not ready."""
    logging.getLogger("tritone").critical("%s: ending the model process", message)
    logging.shutdown()
    os._exit(1)


SHUTTING_DOWN = "server is shutting down: request not accepted"


class Drain:
    """Graceful shutdown across Tritone's processes, signalled by files the launcher owns.

    Triton 2.51 stops every model's scheduler as soon as it is told to exit, so an ensemble
    request whose llm step is still streaming can no longer reach postprocessing: its step fails
    to enqueue, the ensemble never answers, and the server waits out its exit timeout. So the
    launcher drains before it signals tritonserver: it creates `path`; from then on the entry
    model (preprocessing, or llm_inline) refuses new requests, the engine finishes those it
    holds, and once it has held none for `quiet_seconds` it creates `path`.done."""

    def __init__(self, path: str | None, quiet_seconds: float = 0.3, poll_seconds: float = 0.05):
        self.path = path if is_set(path) else None
        self.quiet_seconds, self.poll_seconds = quiet_seconds, poll_seconds

    @property
    def done_path(self) -> str:
        return f"{self.path}.done"

    def requested(self) -> bool:
        # One stat per batch of requests: cheaper than any message from the launcher.
        return self.path is not None and os.path.exists(self.path)

    def watch(self, is_idle: Callable[[], bool], stopping: threading.Event) -> None:
        """In a thread: once a drain is asked for, reports the engine idle. The quiet period
        covers a request between preprocessing and the engine, seen by neither."""
        if self.path is None:
            return

        def run():
            idle_since = None
            while not stopping.wait(self.poll_seconds):
                if not (self.requested() and is_idle()):
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.quiet_seconds:
                    open(self.done_path, "w").close()
                    return

        threading.Thread(target=run, name="tritone-drain", daemon=True).start()
