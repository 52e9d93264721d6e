"""The runner interface that the engine calls, and what every runner shares.

One runner shape for any number of ranks (as nano-vllm's): `prepare` turns the scheduler's
output into arrays, `execute_model` runs the step and samples it, where the logits are, and
returns a StepHandle of token ids and log-probabilities only. ModelRunner (runner.py) does this in
the engine's process; RemoteRunner (multiproc.py) has rank 0 of its worker processes do it while
the other ranks follow in the forward's collectives.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import AutoConfig

from tritone.config import EngineConfig
from tritone.executor import block_table, llama, tensor_parallel
from tritone.executor.step import PendingTokens, SamplingInput, StepHandle, StepInput
from tritone.model_limits import context_length


class Runner(Protocol):
    """What the engine needs of the model."""

    hf_config: object
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    device: torch.device

    def prepare(self, batch, sample_rows: list[int]) -> StepInput:
        """The scheduled batch's model inputs, with logits at the requests `sample_rows`."""

    def execute_model(self, step: StepInput, sampling: SamplingInput, prev: PendingTokens | None = None) -> StepHandle:
        """Computes the step and samples its rows (`prev`: input tokens the host has not seen yet);
        the handle's tokens may still be on their way."""

    def shutdown(self) -> None:
        """Releases what the runner started (worker processes)."""


class RunnerBase:
    """The checkpoint's facts and the block-table rows, for any number of ranks."""

    device: torch.device
    num_blocks: int

    def __init__(self, config: EngineConfig):
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.vocab_size = self.hf_config.get_text_config().vocab_size
        self.max_model_len = context_length(self.hf_config, config.max_model_len)
        self.block_size = config.block_size
        self.block_rows = block_table.BlockTableRows(config.max_num_seqs, -(-self.max_model_len // self.block_size))

    def prepare(self, batch, sample_rows: list[int]) -> StepInput:
        return block_table.prepare_step(self.block_rows, self.block_size, batch, sample_rows)

    def shutdown(self) -> None:
        pass


def kv_head_shape(text_config) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a checkpoint's attention: one row of its KV cache."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads, head_dim


def model_shard(hf_config, rank: int, size: int) -> tensor_parallel.Shard:
    """What rank `rank` of `size` holds of the checkpoint's model (raises naming the flag where the
    heads do not split)."""
    text_config = hf_config.get_text_config()
    num_kv_heads, _ = kv_head_shape(text_config)
    return tensor_parallel.make_shard(rank, size, text_config.num_attention_heads, num_kv_heads,
                                      text_config.intermediate_size, text_config.vocab_size)


def fallback_refused(reason: str, size: int) -> ValueError:
    return ValueError(f"{tensor_parallel.FLAG} {size}: the Hugging Face fallback model ({reason}) runs "
                      "on one device only")


def check_splittable(hf_config, size: int) -> None:
    """Raises ValueError naming the flag where the model cannot be split over `size` ranks: its
    heads do not divide, or it runs on Hugging Face's modules."""
    if size <= 1:
        return
    model_shard(hf_config, 0, size)
    reason = llama.unsupported_reason(hf_config.get_text_config())
    if reason is not None:
        raise fallback_refused(reason, size)
