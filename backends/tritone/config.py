"""The engine's one configuration object, validated at construction and passed whole."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    # Tokens computed per step (decodes plus prefill chunks): bounds the step's latency.
    max_num_batched_tokens: int = 512
    # 0 means the model's own limit (max_position_embeddings).
    max_model_len: int = 0
    block_size: int = 16
    # The KV cache is sized once at start: a byte budget (CPU and GPU), or, when 0, a
    # fraction of free device memory (GPU) or of available RAM (CPU).
    kv_cache_bytes: int = 0
    kv_cache_fraction: float = 0.25
    enable_prefix_caching: bool = True
    seed: int = 0
    # Waiting requests beyond this are refused with a "server busy" error (0: no limit).
    max_queue_len: int = 0
    # CPU threads for the model (0: every core). Every core, though the text stages share them:
    # served on 2 cores, the model on both made more tokens/s than the model on one with the
    # other left to the text stages.
    num_threads: int = 0
    # torch.compile the torch forward path (the native forward is not compiled): auto (on CPU
    # where a C++ compiler is present), on, off. On CUDA the model runs eagerly.
    compile: str = "auto"
    # The forward pass: native (Tritone's Llama family in one native call per step, on CPU in fp32,
    # or in bf16 where the CPU has AVX512-BF16 and Tritone's bf16 GEMM measured fastest), torch (the
    # model's modules, compiled per `compile`), or auto (native wherever it can run).
    forward: str = "auto"
    # Paged attention: auto (the native kernel on CPU; on CUDA the first of flash-varlen, triton
    # that passes a probe batch at start), or one of cpu-native, flash-varlen, triton, sdpa.
    attention: str = "auto"
    # CUDA graphs of decode steps: auto (on CUDA where the model and attention allow), off.
    cuda_graphs: str = "auto"
    # Schedule and prepare step N + 1 while the device computes step N: auto (on CUDA), on, off.
    async_scheduling: str = "auto"
    # The model split over this many ranks (Megatron-style tensor parallelism: GPUs, or CPU core
    # sets), each a worker process; and this many independent engines behind the one model, each
    # request routed to one of them (data parallelism). Above 1, the forward runs in worker
    # processes (tritone.executor.multiproc).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.forward not in ("auto", "native", "torch"):
            raise ValueError(f"forward must be auto, native or torch, got {self.forward!r}")
        if self.attention not in ("auto", "cpu-native", "flash-varlen", "triton", "sdpa"):
            raise ValueError(f"attention must be auto, cpu-native, flash-varlen, triton or sdpa, "
                             f"got {self.attention!r}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.cuda_graphs not in ("auto", "off"):
            raise ValueError(f"cuda_graphs must be auto or off, got {self.cuda_graphs!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_model_len", "kv_cache_bytes", "max_queue_len", "seed", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")

    @classmethod
    def from_parameters(cls, model: str, params: dict[str, str]) -> "EngineConfig":
        """Builds a config from string parameters (Triton model config), ignoring unset ones.

        An unfilled `${template}` or an empty string counts as unset, so the dataclass default holds.
        """
        kwargs = {}
        for field in dataclasses.fields(cls):
            raw = params.get(field.name)
            if field.name == "model" or raw is None or raw == "" or raw.startswith("${"):
                continue
            kwargs[field.name] = _parse(raw, field.type)
        return cls(model=model, **kwargs)


def _parse(raw: str, type_name: str):
    if type_name == "bool":
        lowered = raw.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected a boolean, got {raw!r}")
        return lowered in ("true", "1", "yes")
    if type_name == "int":
        return int(raw)
    if type_name == "float":
        return float(raw)
    return raw
