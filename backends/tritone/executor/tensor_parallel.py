"""Megatron-style tensor parallelism for the Llama family: which slice of each weight a rank holds,
and the collectives between the ranks (torch.distributed: gloo on CPU, NCCL on CUDA).

QKV and gate_up are split by columns (each rank computes its own heads and its own slice of the
MLP), o_proj and down_proj by rows (each rank's partial sum, then one all-reduce), the embedding
and the LM head by vocabulary (the embedding's rows outside a rank's range are zeros until the
all-reduce; the LM head's logits are gathered at the rows that are sampled).

Heads are split by KV head, each with its group of query heads, as evenly as they go: the
default model's 3 KV heads (9 query heads) run on two ranks as 2 + 1. The MLP splits the same
way. A rank that would hold no KV head is refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import timedelta

import torch

FLAG = "--tensor-parallel-size"


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` of `n` items split into `parts` contiguous parts, the first
    n % parts of them one longer."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True, slots=True)
class Shard:
    """What rank `rank` of `size` holds of a model: head, MLP and vocabulary ranges."""

    rank: int
    size: int
    kv_heads: tuple[int, int]  # (start, count) of the model's KV heads
    q_heads: tuple[int, int]  # (start, count) of its query heads: the KV heads' groups
    intermediate: tuple[int, int]  # (start, count) of the MLP's intermediate columns
    vocab: tuple[int, int]  # (start, count) of the vocabulary's rows
    vocab_padded: int  # every rank's LM head width: ceil(vocab / size), the short rank zero-padded

    @property
    def holds_bias(self) -> bool:
        """Whether this rank adds the row-parallel layers' biases (one rank does, or the all-reduce
        would add them `size` times)."""
        return self.rank == 0


def check_size(size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raises ValueError naming the flag when the model's heads cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"{FLAG} must be at least 1, got {size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{FLAG} {size}: {num_heads} query heads do not group evenly over {num_kv_heads} KV heads")
    if size > num_kv_heads:
        raise ValueError(f"{FLAG} {size}: the model has {num_kv_heads} KV heads, fewer than the ranks; "
                         f"use at most {num_kv_heads}")


def make_shard(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate: int, vocab: int) -> Shard:
    check_size(size, num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    kv_start, kv_count = split(num_kv_heads, size, rank)
    return Shard(rank, size, (kv_start, kv_count), (kv_start * group, kv_count * group),
                 split(intermediate, size, rank), split(vocab, size, rank), -(-vocab // size))


def local_spec(spec, shard: Shard):
    """The rank's LlamaSpec: its heads, its MLP slice, its padded vocabulary slice."""
    return dataclasses.replace(spec, num_heads=shard.q_heads[1], num_kv_heads=shard.kv_heads[1],
                               intermediate_size=shard.intermediate[1], vocab_size=shard.vocab_padded)


_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


def shard_tensor(name: str, tensor: torch.Tensor, shard: Shard, head_dim: int) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor `name` (in the checkpoint's [out, in] layout), or None
    where the rank holds zeros instead (row-parallel biases on ranks other than the first)."""
    if shard.size == 1:
        return tensor

    def rows(start_count, unit=1, dim=0):
        start, count = start_count
        return tensor.narrow(dim, start * unit, count * unit)

    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = rows(shard.vocab)
        if part.shape[0] < shard.vocab_padded:
            part = torch.cat([part, part.new_zeros(shard.vocab_padded - part.shape[0], *part.shape[1:])])
        return part
    match = _LAYER.match(name)
    if not match:
        return tensor  # the final norm
    rest = match.group(1)
    if rest.startswith("self_attn.q_proj."):
        return rows(shard.q_heads, head_dim)
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return rows(shard.kv_heads, head_dim)
    if rest == "self_attn.o_proj.weight":
        return rows(shard.q_heads, head_dim, dim=1)
    if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return rows(shard.intermediate)
    if rest == "mlp.down_proj.weight":
        return rows(shard.intermediate, dim=1)
    if rest in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        return tensor if shard.holds_bias else None
    return tensor  # norms (q/k norms are per head dimension, the same on every head)


class Group:
    """The ranks of one engine: all-reduce of partial sums and the gather of the LM head's logits."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 300.0):
        import torch.distributed as dist

        self.dist, self.rank, self.size = dist, rank, size
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        self.backend = backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(x)
        return x

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device="cuda" if self.backend == "nccl" else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [rows, cols] side by side [rows, size * cols] on rank 0 (None elsewhere)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self.dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        try:
            self.dist.destroy_process_group()
        except Exception:
            pass
