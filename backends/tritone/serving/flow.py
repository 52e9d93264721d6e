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

The launcher puts the page in a directory of its own that only the server's user can enter, and
names it in the models' `flow_board` parameter; without it, the page is named after
tritonserver's pid, the parent of every model process. All values are aligned 8-byte words
written whole, so a reader never sees half a write; each slot and cell has one writer at a time.

Postprocessing is a public model: anyone may send it a STATE. A stream's key is its slot on the
page and a random number the llm model wrote there (`new_key`, `register`); a mark counts only for
the key the slot holds, and a send number only up to the stream's last real send, so a forged
STATE marks nothing and makes no other stream's chunk look lost. The keys of ensemble streams
never leave the server: the ensemble does not return STATE.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pathlib
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass

import numpy as np

SLOT_BITS = 16
NUM_SLOTS = 1 << SLOT_BITS  # per stream: its key, its last chunk received, its last send number
_SLOT_FIELDS = 3
_OWNER, _MARK, _SENT = range(_SLOT_FIELDS)
NUM_CELLS = 64  # per postprocessing instance
_CELL_FIELDS = 4  # pid, busy, idle since (monotonic ns, 0 while busy), latest send number received
_PID, _BUSY, _IDLE_SINCE, _LAST_SENT = range(_CELL_FIELDS)
_BYTES = 8 * (NUM_SLOTS * _SLOT_FIELDS + NUM_CELLS * _CELL_FIELDS)

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


def private_directory() -> pathlib.Path:
    """A new directory for one server's page that only this user can enter (the launcher's)."""
    return pathlib.Path(tempfile.mkdtemp(prefix=f"tritone-{os.getpid()}-", dir=_directory()))


def remove_stale(directory: pathlib.Path | None = None) -> int:
    """Removes the pages, and the launchers' directories, of servers that are gone (a killed
    server's llm model never unlinks its own); returns how many. Another user's are left alone.
    The launcher calls it at every start and stop."""
    removed = 0
    for path in (directory or _directory()).glob("tritone-*"):
        pid = path.name.removeprefix("tritone-flow-") if path.name.startswith("tritone-flow-") \
            else path.name.split("-")[1]
        try:
            if not pid.isdigit() or _alive(int(pid)) or path.lstat().st_uid != os.getuid():
                continue
            if path.is_dir() and not path.is_symlink():
                for child in path.iterdir():
                    child.unlink()
                path.rmdir()
            else:
                path.unlink()
            removed += 1
        except OSError:  # removed by another launcher meanwhile
            continue
    return removed


def new_key(slot: int) -> int:
    """A stream's key on the board: its slot, and 46 random bits no client can guess."""
    return ((secrets.randbits(46) | 1) << SLOT_BITS) | slot


class FlowBoard:
    def __init__(self, path: pathlib.Path | str | None = None):
        self.path = pathlib.Path(path) if path else default_path()
        fd = _open_private(self.path)
        try:
            with _locked(fd):
                if os.fstat(fd).st_size < _BYTES:
                    os.ftruncate(fd, _BYTES)
            self._map = mmap.mmap(fd, _BYTES)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64)
        self.slots = words[:NUM_SLOTS * _SLOT_FIELDS].reshape(NUM_SLOTS, _SLOT_FIELDS)
        self.cells = words[NUM_SLOTS * _SLOT_FIELDS:].reshape(NUM_CELLS, _CELL_FIELDS)
        self.cell: int | None = None

    # ---- postprocessing's side

    def claim_cell(self) -> int | None:
        """A cell for this process (one whose process is gone is taken over); None when all are
        held, and then this instance marks chunks but not its idleness."""
        fd = _open_private(self.path)
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
        """At the start of an execute: the (request key, chunk number, send number) of each chunk.
        A mark whose key its slot does not hold is not the llm model's, and counts for nothing."""
        if self.cell is not None:
            self.cells[self.cell, _IDLE_SINCE] = 0
            self.cells[self.cell, _BUSY] = 1
        last = -1
        for key, seq, sent in marks:
            slot = self.slots[key & (NUM_SLOTS - 1)]
            if key <= 0 or slot[_OWNER] != key:
                continue
            if seq > slot[_MARK]:
                slot[_MARK] = seq
            last = max(last, min(sent, int(slot[_SENT])))
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
        before left here and its gone instances."""
        self.slots[:] = 0
        for i, pid in enumerate(self.cells[:, _PID].tolist()):
            if pid and not _alive(pid):
                self.cells[i] = 0

    def register(self, key: int) -> None:
        """A new stream takes its key's slot; marks of the slot's last stream count no more."""
        slot = self.slots[key & (NUM_SLOTS - 1)]
        slot[_OWNER] = 0
        slot[_MARK] = 0
        slot[_SENT] = -1
        slot[_OWNER] = key

    def release(self, key: int) -> None:
        self.slots[key & (NUM_SLOTS - 1), _OWNER] = 0

    def sending(self, key: int, sent: int) -> None:
        """Before a chunk goes out: the highest send number a mark of this stream may claim."""
        self.slots[key & (NUM_SLOTS - 1), _SENT] = sent

    def is_received(self, key: int, seq: int) -> bool:
        """Whether chunk `seq` of stream `key` (or a later one) reached postprocessing."""
        slot = self.slots[key & (NUM_SLOTS - 1)]
        return slot[_OWNER] == key and slot[_MARK] >= seq

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


def _open_private(path: pathlib.Path) -> int:
    """The page, opened or made, if it is a plain file of this user that no one else may read: a
    link or another user's file put in its place (its name can be guessed) is refused."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise RuntimeError(f"flow board {path}: not a private file of this user (remove it, or start the server "
                           "with its launcher, which makes a private directory for it)")
    return fd


@contextlib.contextmanager
def _locked(fd: int):
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
