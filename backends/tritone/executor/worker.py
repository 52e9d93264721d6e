"""A model worker process: one rank of one engine (tensor and data parallelism, multiproc.py).

It builds its part of the model, then runs each step it is sent: every rank of an engine gets the
step's inputs once, from the engine's process, and the ranks meet only in the forward pass's
collectives. The first rank writes the gathered logits (or greedy tokens) into memory shared with
the engine and answers with their shape. Any failure ends the process: the engine sees its
connection close and restarts the engine's workers.

Run as `python -m tritone.executor.worker SPEC_JSON` by multiproc.RemoteRunner only.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import sys
from multiprocessing.connection import Connection

import numpy as np
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

    from transformers import AutoConfig

    from tritone.config import EngineConfig
    from tritone.executor import hardware, tensor_parallel
    from tritone.executor.runner import ModelRunner, model_shard, num_kv_blocks

    try:
        config = EngineConfig(**spec["config"])
        device = hardware.resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = None
        num_blocks = 0
        if size > 1:
            group = tensor_parallel.Group(rank, size, spec["init_method"], device, spec.get("shm_fd"),
                                          spec.get("shm_bytes", 0))
            hf_config = AutoConfig.from_pretrained(config.model)
            dtype = hardware.resolve_dtype(config.dtype, device)
            # Every rank's cache has as many blocks as the smallest one holds.
            num_blocks = group.min(num_kv_blocks(config, hf_config, dtype, device,
                                                 model_shard(hf_config, rank, size)))
        runner = ModelRunner(config, group, num_blocks)
    except Exception as exc:
        logger.exception("the model could not start")
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", runner.num_blocks, str(runner.dtype).removeprefix("torch."),
               f"{runner.device}, {torch.get_num_threads()} threads" + (f" on CPUs {spec['cpus']}" if spec["cpus"] else "")))
    out_map = None
    if rank == 0:
        out_map = mmap.mmap(spec["out_fd"], spec["out_bytes"])
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the engine's process is gone
            return 0
        if message is None:
            return 0
        step, greedy = message
        try:
            with torch.inference_mode():
                out = runner.execute(step, greedy)
            if rank == 0:
                out = out.cpu().contiguous()
                flat = np.frombuffer(out_map, dtype=np.float32 if out.dtype == torch.float32 else np.int64,
                                     count=out.numel())
                flat[:] = out.numpy().reshape(-1)
                conn.send(tuple(out.shape))
        except Exception as exc:
            logger.exception("a step failed")
            try:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
