"""A model worker process: one rank of one engine (tensor and data parallelism, multiproc.py).

It builds its part of the model, then runs each step it is sent: every rank of an engine gets the
step's inputs once, from the engine's process, and the ranks meet only in the forward pass's
collectives. The first rank also gets the step's sampling, samples the gathered logits and
answers with the token ids and log-probabilities. Any failure ends the process: the engine sees
its connection close and restarts the engine's workers.

Run as `python -m tritone.executor.worker SPEC_JSON` by multiproc.RemoteRunner only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

import torch

from tritone.processes import die_with_parent


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    # SIGKILL when the engine's process dies, whatever it died of (no orphan holds the cores).
    die_with_parent(signal.SIGKILL, spec["parent"])
    engine, rank, size = spec["engine"], spec["rank"], spec["size"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"tritone worker {engine}.{rank}: %(levelname)s %(name)s: %(message)s")
    logger = logging.getLogger("tritone.executor.worker")
    conn = Connection(spec["conn_fd"])
    if spec["cpus"]:
        os.sched_setaffinity(0, spec["cpus"])

    from tritone.config import EngineConfig
    from tritone.executor import hardware, tensor_parallel
    from tritone.executor.runner import ModelRunner

    try:
        config = EngineConfig(**spec["config"])
        device = hardware.resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = None
        if size > 1:
            group = tensor_parallel.Group(rank, size, spec["init_method"], device, spec.get("shm_fd"),
                                          spec.get("shm_bytes", 0))
        # The ranks agree on the KV cache's blocks inside (the smallest any of them holds).
        runner = ModelRunner(config, group)
    except Exception as exc:
        logger.exception("the model could not start")
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", runner.num_blocks, str(runner.dtype).removeprefix("torch."),
               f"{runner.device}, {torch.get_num_threads()} threads" + (f" on CPUs {spec['cpus']}" if spec["cpus"] else "")))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the engine's process is gone
            return 0
        if message is None:
            return 0
        step, sampling = message
        try:
            handle = runner.execute_model(step, sampling)
            if rank == 0:
                conn.send(("done", *handle.result(), _host_rows(handle.top), _host_rows(handle.scores)))
        except Exception as exc:
            logger.exception("a step failed")
            try:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass
            return 1


def _host_rows(rows) -> dict | None:
    """A handle's TopRows as plain rows for the engine's process."""
    return None if rows is None else rows.by_row()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
