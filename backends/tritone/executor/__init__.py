"""The model executor: model definitions, paged attention, compilation, and the runner that
turns a scheduled batch into sampled tokens (the Runner interface, base.py). Nothing here knows
about Triton or requests' text."""

from tritone.config import EngineConfig
from tritone.executor.base import Runner
from tritone.executor.memory import kv_bytes_per_token
from tritone.executor.runner import ModelRunner


def make_runner(config: EngineConfig, engine: int = 0) -> Runner:
    """The model of engine `engine`: in this process, or, under tensor or data parallelism, in
    worker processes (a RemoteRunner, whose failures raise multiproc.WorkerDied)."""
    if config.tensor_parallel_size == 1 and config.data_parallel_size == 1:
        return ModelRunner(config)
    from tritone.executor.multiproc import RemoteRunner

    return RemoteRunner(config, engine)


__all__ = ["ModelRunner", "Runner", "kv_bytes_per_token", "make_runner"]
