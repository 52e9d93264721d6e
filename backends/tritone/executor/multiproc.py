"""An engine's model in worker processes, one per tensor-parallel rank (worker.py), started and
supervised from the engine's process, which keeps the scheduler and the block manager.

Each step's inputs go to every rank once, pickled down its own socket, and its sampling (which
request each row samples for, new requests' parameters once, grammar masks) to the first rank;
the ranks meet only in the forward's collectives (gloo on CPU, NCCL on CUDA). The first rank
samples where the gathered logits are and answers with the token ids and log-probabilities
alone: no logits cross a process.
Waiting for that answer, this process watches every rank's socket: a rank that dies closes it,
and the step raises WorkerDied at once (no hang in a collective), after which the engine's
requests end with an error and the engine restarts (tritone.engine.async_engine). A rank that
hangs without dying is treated the same once a step has waited STEP_TIMEOUT_SECONDS.

Data parallelism runs one RemoteRunner per engine, even at one rank, so that each engine's
forward has its own process, threads and CPUs (or GPU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import torch

from tritone.config import EngineConfig
from tritone.executor import hardware, tensor_parallel
from tritone.executor.base import RunnerBase, check_splittable
from tritone.executor.step import PendingTokens, ReadyRows, SamplingInput, StepHandle, StepInput

logger = logging.getLogger(__name__)

DP_FLAG = "--data-parallel-size"


# A step's watchdog: far past any step's time (a step of the default model on 2 CPU cores takes
# milliseconds to a second; a first call at a new batch shape may compile for tens of seconds).
STEP_TIMEOUT_SECONDS = float(os.environ.get("TRITONE_STEP_TIMEOUT", "300"))
# A start's watchdog: loading, measuring and compiling an 8B model's rank, with room to spare.
START_TIMEOUT_SECONDS = 1800.0


class WorkerDied(RuntimeError):
    """A worker of the engine died or failed a step: the engine's requests end with an error and
    the engine restarts."""


def _python() -> str:
    """The interpreter for workers: this one, or, inside Triton's Python backend stub (an embedded
    interpreter), its base interpreter with this process's module path."""
    exe = sys.executable
    if exe and pathlib.Path(exe).name.startswith("python") and os.access(exe, os.X_OK):
        return exe
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (pathlib.Path(sys.base_exec_prefix) / "bin" / f"python{version}",
                      pathlib.Path(sys.base_exec_prefix) / "bin" / "python3"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(f"no Python {version} interpreter found for the model workers")


def _rendezvous() -> tuple[str, pathlib.Path]:
    """Where the ranks meet: a file in a new directory only this user can enter. A TCP store
    would listen on every interface, on a port picked and let go before it is bound again."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="tritone-rendezvous-"))
    return f"file://{directory / 'store'}", directory


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank of one engine runs: its device, and on CPU its cores and threads."""

    device: str
    cpus: list[int] | None
    num_threads: int


def placements(config: EngineConfig, engine: int) -> list[Placement]:
    """The ranks of engine `engine`: GPUs in order (engine e's rank r on GPU e * tp + r), or on
    CPU an equal slice of this process's CPUs each, pinned. Raises ValueError naming the flags
    where the machine has fewer devices than ranks."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    flags = f"{tensor_parallel.FLAG} {tp} {DP_FLAG} {dp}"
    device = hardware.resolve_device(config.device)
    if device.type == "cuda":
        first = device.index or 0
        available = torch.cuda.device_count() - first
        if tp * dp > available:
            raise ValueError(f"{flags}: {tp * dp} ranks need as many GPUs, and {available} are visible")
        return [Placement(f"cuda:{first + engine * tp + r}", None, 0) for r in range(tp)]
    cpus = sorted(os.sched_getaffinity(0))
    if tp * dp > len(cpus):
        raise ValueError(f"{flags}: {tp * dp} ranks need as many CPUs, and this process may use {len(cpus)}")
    per = len(cpus) // (tp * dp)
    threads = max(1, (config.num_threads or len(cpus)) // (tp * dp))
    out = []
    for r in range(tp):
        w = engine * tp + r
        out.append(Placement("cpu", cpus[w * per:(w + 1) * per], threads))
    return out


class RemoteRunner(RunnerBase):
    """The Runner (base.py) of an engine whose model runs in worker processes: rank 0 drives
    (it samples and answers), the others follow."""

    def __init__(self, config: EngineConfig, engine: int = 0):
        super().__init__(config)
        self.config, self.engine_index = config, engine
        check_splittable(self.hf_config, config.tensor_parallel_size)
        # Sampled tokens come back to the host: the next step's inputs are patched here.
        self.device = torch.device("cpu")
        self._procs: list[subprocess.Popen] = []
        self._rendezvous_dir: pathlib.Path | None = None
        self._conns: list = []
        self.dead: str | None = None
        self._start(placements(config, engine))

    def _start(self, ranks: list[Placement]) -> None:
        config, tp = self.config, len(ranks)
        # The dtype is decided once, here, so that every rank runs the same one.
        dtype = self.dtype = hardware.resolve_dtype(config.dtype, hardware.resolve_device(ranks[0].device))
        # The ranks of a CPU engine share a region for their all-reduces and their logits' gather.
        shm_fd, shm_bytes = None, 0
        if tp > 1 and ranks[0].device == "cpu":
            shm_bytes = tensor_parallel.shm_region_bytes(tp, config.max_num_seqs, self.vocab_size)
            if shm_bytes:
                shm_fd = os.memfd_create("tritone-tensor-parallel")
                os.ftruncate(shm_fd, shm_bytes)
        init_method, self._rendezvous_dir = _rendezvous()
        env = dict(os.environ)
        # The ranks' own connections (gloo's, NCCL's bootstrap) on loopback: they share one host.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.exists(p))
        try:
            for rank, place in enumerate(ranks):
                ours, theirs = multiprocessing.Pipe(duplex=True)
                worker_config = dataclasses.replace(config, device=place.device, dtype=str(dtype).removeprefix("torch."),
                                                    num_threads=place.num_threads)
                spec = {"config": dataclasses.asdict(worker_config), "engine": self.engine_index, "rank": rank,
                        "size": tp, "init_method": init_method, "conn_fd": theirs.fileno(), "cpus": place.cpus,
                        "parent": os.getpid(), "shm_fd": shm_fd, "shm_bytes": shm_bytes}
                fds = (theirs.fileno(),) + ((shm_fd,) if shm_fd is not None else ())
                self._procs.append(subprocess.Popen([_python(), "-m", "tritone.executor.worker", json.dumps(spec)],
                                                    env=env, pass_fds=fds, stdin=subprocess.DEVNULL))
                theirs.close()
                self._conns.append(ours)
            if shm_fd is not None:
                os.close(shm_fd)
            replies = self._await_start()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = replies[0][1]
        logger.info("engine %d: the model in %d worker process%s (%s); KV cache %d blocks of %d tokens",
                    self.engine_index, tp, "es" if tp > 1 else "", "; ".join(f"rank {r}: {reply[3]}" for r, reply in
                                                                           enumerate(replies)),
                    self.num_blocks, self.block_size)

    def _await_start(self) -> list:
        """Every rank's start-up reply, taken as each comes: a rank that fails fails the start at
        once (its peers may be waiting for it in a collective, and are killed), and one that has
        not answered after START_TIMEOUT_SECONDS counts as failed."""
        pending, replies = dict(enumerate(self._conns)), {}
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"engine {self.engine_index}: model workers {sorted(pending)} did not start within "
                                   f"{START_TIMEOUT_SECONDS:.0f} s")
            for conn in ready:
                rank = self._conns.index(conn)
                replies[rank] = self._receive(conn, rank, "starting")
                del pending[rank]
        return [replies[rank] for rank in range(len(self._conns))]

    def _receive(self, conn, rank: int, doing: str):
        try:
            reply = conn.recv()
        except (EOFError, OSError):
            reply = None
        if reply is None or (isinstance(reply, tuple) and reply and reply[0] == "error"):
            why = reply[1] if reply is not None else f"its process ended ({self._exit_status(rank)})"
            if doing == "starting":
                raise RuntimeError(f"engine {self.engine_index}: model worker {rank} failed while starting: {why}")
            raise WorkerDied(f"model worker {rank} of engine {self.engine_index} failed while {doing}: {why}")
        return reply

    def _exit_status(self, rank: int) -> str:
        try:
            code = self._procs[rank].wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def execute_model(self, step: StepInput, sampling: SamplingInput, prev: PendingTokens | None = None) -> StepHandle:
        """As ModelRunner.execute_model: the ranks run the step, rank 0 samples it and answers with
        the token ids and log-probabilities, here on the host when this returns."""
        if self.dead is not None:
            raise WorkerDied(self.dead)
        if prev is not None:  # the previous step's tokens are on the host here
            step = dataclasses.replace(step, ids=prev.patch(step.ids))
        follow = bytes(ForkingPickler.dumps((step, None)))
        try:
            self._conns[0].send_bytes(bytes(ForkingPickler.dumps((step, sampling))))
            for conn in self._conns[1:]:
                conn.send_bytes(follow)
            # The first rank answers; any other rank that speaks has failed, and one that died has
            # closed its socket: either wakes this wait.
            ready = wait(self._conns, timeout=STEP_TIMEOUT_SECONDS)
            if not ready:  # a rank that hangs (in a collective, in a driver) is as good as dead
                raise WorkerDied(f"model worker 0 of engine {self.engine_index} did not finish a step within "
                                 f"{STEP_TIMEOUT_SECONDS:.0f} s")
            for rank in sorted(self._conns.index(c) for c in ready):
                reply = self._receive(self._conns[rank], rank, "running a step")
                if rank:
                    raise WorkerDied(f"model worker {rank} of engine {self.engine_index} spoke out of turn: {reply}")
        except (WorkerDied, OSError) as exc:
            self.dead = str(exc) if isinstance(exc, WorkerDied) else f"a model worker's socket failed: {exc}"
            logger.error("engine %d: %s", self.engine_index, self.dead)
            self.shutdown(graceful=False)
            raise WorkerDied(self.dead) from None
        _, token_ids, log_probs, top, scores = reply
        handle = StepHandle(torch.tensor(token_ids, dtype=torch.int64),
                            torch.tensor(log_probs) if log_probs is not None else None, len(token_ids))
        handle.top = None if top is None else ReadyRows(top)
        handle.scores = None if scores is None else ReadyRows(scores)
        return handle

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the workers: asked first and killed after a moment, or (after a failure, when the
        others may wait in a collective for the one that failed) killed at once."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if not graceful:
                proc.kill()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None
