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

import ctypes
import dataclasses
import logging
import mmap
import re
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

logger = logging.getLogger(__name__)

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


# Floats per rank and slot of the shared-memory all-reduce: a longer call goes in pieces.
SHM_CHUNK = 1 << 18


def shm_region_bytes(size: int, max_rows: int, vocab: int) -> int:
    """Bytes of the region an engine's ranks share on one host: the all-reduce's slots, then a
    slot per rank for its logits [max_rows, vocab_padded] (the gather)."""
    from tritone.executor import kernels

    lib = kernels.native_library()
    if lib is None:
        return 0
    return -(-lib.shm_comm_bytes(size, SHM_CHUNK) // 4096) * 4096 + size * max_rows * (-(-vocab // size)) * 4


class _ShmComm(ctypes.Structure):
    """Mirror of csrc/kernels.h's ShmComm."""

    _fields_ = [("rank", ctypes.c_int), ("size", ctypes.c_int), ("chunk", ctypes.c_int64), ("calls", ctypes.c_uint64),
                ("seq", ctypes.c_void_p), ("data", ctypes.c_void_p)]


class Group:
    """The ranks of one engine: all-reduce of partial sums and the gather of the LM head's logits.

    torch.distributed sets the group up (NCCL on CUDA, gloo on CPU). On CPU, where the engine's
    process hands the ranks a shared region (`shm_fd`), the per-layer all-reduces and the per-step
    gather go through it instead, if it measured faster than gloo at start (logged): gloo's go
    through loopback TCP."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device, shm_fd: int | None = None,
                 shm_bytes: int = 0, timeout_s: float = 300.0):
        import torch.distributed as dist

        self.dist, self.rank, self.size = dist, rank, size
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        self.backend = backend
        self.shm = None
        if shm_fd is not None and shm_bytes and backend == "gloo":
            self._setup_shm(shm_fd, shm_bytes)
        self.all_reduce_name = "shared memory" if self.shm is not None else backend

    def _setup_shm(self, fd: int, nbytes: int) -> None:
        from tritone.executor import kernels

        lib = kernels.native_library()
        self._map = mmap.mmap(fd, nbytes)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._comm = _ShmComm()
        lib.shm_comm_init(ctypes.byref(self._comm), base, self.rank, self.size, SHM_CHUNK)
        gather_at = -(-lib.shm_comm_bytes(self.size, SHM_CHUNK) // 4096) * 4096
        self._gather = np.frombuffer(self._map, dtype=np.float32, offset=gather_at,
                                     count=(nbytes - gather_at) // 4).reshape(self.size, -1)
        self._lib = lib
        # Measured, not assumed: a decode token's all-reduce both ways, the same calls on every rank.
        x = torch.ones(2048)
        gloo_s, shm_s = self._time(lambda: self.dist.all_reduce(x)), self._time(lambda: self._shm_reduce(x))
        choice = torch.tensor([int(shm_s < gloo_s)])
        self.dist.broadcast(choice, src=0)  # rank 0's measurement decides for all
        if choice.item():
            self.shm = self._comm
        logger.info("tensor parallel all-reduce of 2048 floats: shared memory %.0f us, gloo %.0f us; using %s",
                    shm_s * 1e6, gloo_s * 1e6, "shared memory" if self.shm is not None else "gloo")

    def _time(self, fn, calls: int = 30) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    def _shm_reduce(self, x: torch.Tensor) -> None:
        self._lib.shm_all_reduce(ctypes.byref(self._comm), x.data_ptr(), x.numel())

    def native_all_reduce(self) -> tuple[int, int] | None:
        """(function, context) addresses for the native forward's all-reduce, where it is native."""
        if self.shm is None:
            return None
        return ctypes.cast(self._lib.shm_all_reduce, ctypes.c_void_p).value, ctypes.addressof(self._comm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is None:
            self.dist.all_reduce(x)
        elif x.dtype == torch.float32 and x.is_contiguous():
            self._shm_reduce(x)
        else:
            y = x.float().contiguous()
            self._shm_reduce(y)
            x.copy_(y)
        return x

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device="cuda" if self.backend == "nccl" else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [rows, cols] side by side [rows, size * cols] on rank 0 (None elsewhere)."""
        x = x.contiguous()
        if self.shm is not None and x.numel() <= self._gather.shape[1] and x.dtype == torch.float32:
            # Each rank's slot, then a barrier; the slots are written again only after rank 0 has
            # answered this step (the next step comes after its answer).
            self._gather[self.rank, :x.numel()] = x.numpy().reshape(-1)
            self._lib.shm_all_reduce(ctypes.byref(self._comm), None, 0)
            if self.rank:
                return None
            n = x.numel()
            return torch.cat([torch.from_numpy(self._gather[r, :n].reshape(x.shape)) for r in range(self.size)], dim=1)
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self.dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None
