"""An engine's model in worker processes, one per tensor-parallel rank (worker.py), started and
supervised from the engine's process, which keeps the scheduler, the sampler and the block manager.

Each step's inputs go to every rank once, pickled down its own socket; the ranks meet only in
the forward's collectives (gloo on CPU, NCCL on CUDA), and the first rank writes the gathered
logits, or the greedy tokens, into memory shared with this process and answers with their shape.
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
import mmap
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from transformers import AutoConfig

from tritone.config import EngineConfig
from tritone.executor import block_table, hardware, llama, tensor_parallel
from tritone.executor.runner import StepHandle, model_shard
from tritone.executor.step import PendingTokens, StepInput

logger = logging.getLogger(__name__)

DP_FLAG = "--data-parallel-size"


# A step's watchdog: far past any step's time (a step of the default model on 2 CPU cores takes
# milliseconds to a second; a first call at a new batch shape may compile for tens of seconds).
STEP_TIMEOUT_SECONDS = float(os.environ.get("TRITONE_STEP_TIMEOUT", "300"))


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


class RemoteRunner:
    """The runner interface of ModelRunner (prepare, execute, finish_step, num_blocks, ...), for an
    engine whose model runs in worker processes."""

    def __init__(self, config: EngineConfig, engine: int = 0):
        self.config, self.engine_index = config, engine
        self.hf_config = AutoConfig.from_pretrained(config.model)
        text_config = self.hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = config.max_model_len or text_config.max_position_embeddings
        self.block_size = config.block_size
        tp = config.tensor_parallel_size
        if tp > 1:
            model_shard(self.hf_config, 0, tp)  # heads that do not split are refused here
            reason = llama.unsupported_reason(text_config)
            if reason is not None:
                raise ValueError(f"{tensor_parallel.FLAG} {tp}: the Hugging Face fallback model ({reason}) runs "
                                 "on one device only")
        # The sampler reads the logits here, on the host.
        self.device = torch.device("cpu")
        self.block_rows = block_table.BlockTableRows(config.max_num_seqs, -(-self.max_model_len // self.block_size))
        self._procs: list[subprocess.Popen] = []
        self._rendezvous_dir: pathlib.Path | None = None
        self._conns: list = []
        self._out: mmap.mmap | None = None
        self.dead: str | None = None
        self._start(placements(config, engine))

    def _start(self, ranks: list[Placement]) -> None:
        config, tp = self.config, len(ranks)
        # The dtype is decided once, here, so that every rank runs the same one.
        dtype = self.dtype = hardware.resolve_dtype(config.dtype, hardware.resolve_device(ranks[0].device))
        out_bytes = max(8, config.max_num_seqs * self.vocab_size * 4)
        out_fd = os.memfd_create("tritone-step-output")
        os.ftruncate(out_fd, out_bytes)
        self._out = mmap.mmap(out_fd, out_bytes)
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
                        "out_fd": out_fd, "out_bytes": out_bytes, "parent": os.getpid(), "shm_fd": shm_fd,
                        "shm_bytes": shm_bytes}
                fds = (theirs.fileno(), out_fd) if rank == 0 else (theirs.fileno(),)
                fds += (shm_fd,) if shm_fd is not None else ()
                self._procs.append(subprocess.Popen([_python(), "-m", "tritone.executor.worker", json.dumps(spec)],
                                                    env=env, pass_fds=fds, stdin=subprocess.DEVNULL))
                theirs.close()
                self._conns.append(ours)
            os.close(out_fd)
            if shm_fd is not None:
                os.close(shm_fd)
            replies = [self._receive(conn, rank, "starting") for rank, conn in enumerate(self._conns)]
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = replies[0][1]
        logger.info("engine %d: the model in %d worker process%s (%s); KV cache %d blocks of %d tokens",
                    self.engine_index, tp, "es" if tp > 1 else "", "; ".join(f"rank {r}: {reply[3]}" for r, reply in
                                                                           enumerate(replies)),
                    self.num_blocks, self.block_size)

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

    def prepare(self, batch, sample_rows: list[int]) -> StepInput:
        return block_table.prepare_step(self.block_rows, self.block_size, batch, sample_rows)

    def execute(self, step: StepInput, greedy: bool = False, prev: PendingTokens | None = None) -> torch.Tensor:
        """As ModelRunner.execute: the ranks run the step; logits [rows, vocab] float32 (a view of the
        shared memory, valid until the next step) or greedy tokens [rows] int64."""
        if self.dead is not None:
            raise WorkerDied(self.dead)
        if prev is not None:  # the previous step's tokens are on the host here
            ids = step.ids.copy()
            ids[prev.dst] = prev.token_ids.cpu().numpy()[prev.src]
            step = dataclasses.replace(step, ids=ids)
        payload = bytes(ForkingPickler.dumps((step, greedy)))
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
            # The first rank answers; any other rank that speaks has failed, and one that died has
            # closed its socket: either wakes this wait.
            ready = wait(self._conns, timeout=STEP_TIMEOUT_SECONDS)
            if not ready:  # a rank that hangs (in a collective, in a driver) is as good as dead
                raise WorkerDied(f"model worker 0 of engine {self.engine_index} did not finish a step within "
                                 f"{STEP_TIMEOUT_SECONDS:.0f} s")
            for rank in sorted(self._conns.index(c) for c in ready):
                shape = self._receive(self._conns[rank], rank, "running a step")
                if rank:
                    raise WorkerDied(f"model worker {rank} of engine {self.engine_index} spoke out of turn: {shape}")
        except (WorkerDied, OSError) as exc:
            self.dead = str(exc) if isinstance(exc, WorkerDied) else f"a model worker's socket failed: {exc}"
            logger.error("engine %d: %s", self.engine_index, self.dead)
            self.shutdown(graceful=False)
            raise WorkerDied(self.dead) from None
        count = int(np.prod(shape))
        if greedy:
            return torch.from_numpy(np.frombuffer(self._out, dtype=np.int64, count=count).copy())
        return torch.frombuffer(self._out, dtype=torch.float32, count=count).view(*shape)

    def finish_step(self, token_ids: torch.Tensor, log_probs: torch.Tensor | None, num_rows: int) -> StepHandle:
        return StepHandle(token_ids, log_probs, num_rows)

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
