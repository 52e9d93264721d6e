"""What the llm model learns from postprocessing without a message: a page of shared memory.

Postprocessing runs under Triton's dynamic batcher, so that one execute (one round trip between
tritonserver and the model's process) carries every chunk that arrived together, and its
`preserve_ordering` keeps a stream's chunks in order across instances. The batcher answers a
chunk of a cancelled ensemble request itself, so postprocessing never sees it and cannot tell the
engine; and Triton 2.51 never tells the running llm step either (server issue #6739). So each
postprocessing instance marks here, at the start of every execute, the chunks it received, and
whether it is busy; the llm model reads the marks:

- flow control: a stream whose last chunk has not reached postprocessing yet holds its new tokens
  and sends them with the next chunk (one response for several tokens, as vLLM's output collector
  does when the front end falls behind); when the path keeps up, every token goes alone;
- cancellation: a chunk is lost (the batcher refused it: its ensemble request was cancelled) when
  postprocessing received a later chunk, or sat idle with an empty queue, long after it was sent.

The page is named after tritonserver's pid, the parent of every model process, so the models find
it without configuration. All values are aligned 8-byte words written whole, so a reader never
sees half a write; each slot and cell has one writer at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass

import numpy as np

NUM_SLOTS = 1 << 16  # per stream: (key << SEQ_BITS) | chunk sequence number, of its last chunk received
NUM_CELLS = 64  # per postprocessing instance
SEQ_BITS = 24
_CELL_FIELDS = 4  # pid, busy, idle since (monotonic ns, 0 while busy), latest send number received
_PID, _BUSY, _IDLE_SINCE, _LAST_SENT = range(_CELL_FIELDS)
_BYTES = 8 * (NUM_SLOTS + NUM_CELLS * _CELL_FIELDS)

# A chunk counts as lost only this long after it was sent, and only on evidence this old: the
# batcher hands a batch to an instance within microseconds, and its stub marks it at once, so
# these cover a process waiting for a core on a loaded machine many times over.
LOST_AFTER_S = 0.25
EVIDENCE_AGE_S = 0.1


def _directory() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() else pathlib.Path(tempfile.gettempdir())


def default_path() -> pathlib.Path:
    """The page of the tritonserver this process belongs to (its parent)."""
    return _directory() / f"tritone-flow-{os.getppid()}"


def remove_stale(directory: pathlib.Path | None = None) -> int:
    """Removes the pages of servers that are gone (a killed server's llm model never unlinks
    its own); returns how many. The launcher calls it at every start and stop."""
    removed = 0
    for path in (directory or _directory()).glob("tritone-flow-*"):
        pid = path.name.removeprefix("tritone-flow-")
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class FlowBoard:
    def __init__(self, path: pathlib.Path | str | None = None):
        self.path = pathlib.Path(path) if path else default_path()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with _locked(fd):
                if os.fstat(fd).st_size < _BYTES:
                    os.ftruncate(fd, _BYTES)
            self._map = mmap.mmap(fd, _BYTES)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64)
        self.slots = words[:NUM_SLOTS]
        self.cells = words[NUM_SLOTS:].reshape(NUM_CELLS, _CELL_FIELDS)
        self.cell: int | None = None

    # ---- postprocessing's side

    def claim_cell(self) -> int | None:
        """A cell for this process (one whose process is gone is taken over); None when all are
        held, and then this instance marks chunks but not its idleness."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            with _locked(fd):
                for i, pid in enumerate(self.cells[:, _PID].tolist()):
                    if pid == 0 or pid == os.getpid() or not _alive(pid):
                        self.cells[i] = (os.getpid(), 0, time.monotonic_ns(), -1)
                        self.cell = i
                        return i
        finally:
            os.close(fd)
        return None

    def received(self, marks: list[tuple[int, int, int]]) -> None:
        """At the start of an execute: the (request key, chunk number, send number) of each chunk."""
        if self.cell is not None:
            self.cells[self.cell, _IDLE_SINCE] = 0
            self.cells[self.cell, _BUSY] = 1
        last = -1
        for key, seq, sent in marks:
            self.slots[key % NUM_SLOTS] = (key << SEQ_BITS) | seq
            last = max(last, sent)
        if self.cell is not None and last > self.cells[self.cell, _LAST_SENT]:
            self.cells[self.cell, _LAST_SENT] = last

    def done(self) -> None:
        """At the end of an execute."""
        if self.cell is not None:
            self.cells[self.cell, _BUSY] = 0
            self.cells[self.cell, _IDLE_SINCE] = time.monotonic_ns()

    # ---- the llm model's side

    def reset(self) -> None:
        """At the llm model's start, before any chunk: forgets what a server that had this pid
        before left here (its streams' keys start again from 0) and its gone instances."""
        self.slots[:] = 0
        for i, pid in enumerate(self.cells[:, _PID].tolist()):
            if pid and not _alive(pid):
                self.cells[i] = 0

    def is_received(self, key: int, seq: int) -> bool:
        """Whether chunk `seq` of stream `key` (or a later one) reached postprocessing. Keys only
        grow: a slot that holds an earlier key has no mark of this stream yet; one taken by a
        stream 65,536 keys later reads as received, and this stream is then never held."""
        word = int(self.slots[key % NUM_SLOTS])
        marked = word >> SEQ_BITS
        return marked > key or (marked == key and (word & ((1 << SEQ_BITS) - 1)) >= seq)

    def evidence(self, now_ns: int) -> "Evidence":
        """What postprocessing's instances show now: the latest send number any received, and
        whether one has been idle for a while (then nothing waits in its queue)."""
        live = self.cells[self.cells[:, _PID] != 0]
        idle = live[(live[:, _BUSY] == 0) & (live[:, _IDLE_SINCE] > 0)]
        return Evidence(now_ns, int(live[:, _LAST_SENT].max()) if len(live) else -1,
                        int(idle[:, _IDLE_SINCE].min()) if len(idle) else 0)

    def close(self) -> None:
        self.slots = self.cells = None
        self._map.close()


@dataclass(frozen=True, slots=True)
class Evidence:
    at_ns: int
    last_sent_received: int
    idle_since_ns: int  # 0: no instance idle


@dataclass(slots=True)
class ChunkWatch:
    """The llm model's record of a stream's last chunk in flight, and the evidence seen since it
    was sent that it will never arrive."""

    key: int
    seq: int
    sent: int  # the send number: all streams' chunks, in the order they were sent
    sent_at_ns: int
    suspect_since_ns: int = 0

    def is_lost(self, board: FlowBoard, evidence: Evidence) -> bool:
        if board.is_received(self.key, self.seq):
            return False
        # An instance idle all this time would have taken the chunk from the queue at once.
        idle_ns = evidence.at_ns - max(evidence.idle_since_ns, self.sent_at_ns) if evidence.idle_since_ns else 0
        if not (evidence.last_sent_received > self.sent or idle_ns >= EVIDENCE_AGE_S * 1e9):
            self.suspect_since_ns = 0
            return False
        if not self.suspect_since_ns:
            self.suspect_since_ns = evidence.at_ns
        # Decided on evidence that has held a while: a chunk handed to an instance that had not
        # marked it yet is marked by then.
        return (evidence.at_ns - self.sent_at_ns >= LOST_AFTER_S * 1e9
                and evidence.at_ns - self.suspect_since_ns >= EVIDENCE_AGE_S * 1e9
                and not board.is_received(self.key, self.seq))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(fd: int):
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
