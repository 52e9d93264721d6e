"""Paged attention as one call per layer for the whole packed batch.

Every layer's attention goes through the custom op `tritone::paged_attention`, which writes the
step's new keys and values into the layer's paged cache and attends each sequence's new tokens
(decodes, prompt chunks, tails after prefix hits alike) over its context. The op is opaque to
`torch.compile`: the compiled graph holds the model's arithmetic, and the cache and the step's
metadata reach the op through a forward context that the runner sets around each forward pass,
as vLLM does, so that neither the cache nor the block tables become graph inputs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritone.executor import kernels

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer; built once per step by the runner."""

    # [num_padded_tokens] int64: where each new token's K/V goes; padding rows go to a spare
    # slot past the last block, which no block table names.
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32: sequence s owns token rows [qs[s], qs[s+1])
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    # Host copies for the torch path, which loops over sequences.
    query_start_list: list[int]
    seq_lens_list: list[int]
    num_decodes: int  # the first num_decodes sequences have one query token each
    block_size: int


class NativeCPUAttention:
    """The C kernel: reads the cache in place through block tables, no gather."""

    name = "cpu-native"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        qf = q.float().contiguous()
        out = torch.zeros_like(qf)
        kernels.paged_attention(qf, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                                meta.block_size, scale, out)
        return out.to(q.dtype)


class TorchSDPAAttention:
    """Gathers each sequence's context out of the cache, then SDPA: the portable fallback.

    Decodes are attended together in one padded call; prompt chunks one sequence at a time."""

    name = "sdpa"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        qs, lens, bs = meta.query_start_list, meta.seq_lens_list, meta.block_size
        nd = meta.num_decodes
        if nd:
            width = max(lens[:nd])
            slots = _context_slots(meta.block_tables[:nd], width, bs)  # [nd, width]
            k = _gather(k_cache, slots).transpose(1, 2)  # [nd, kv_heads, width, D]
            v = _gather(v_cache, slots).transpose(1, 2)
            mask = torch.arange(width, device=q.device)[None, :] < meta.seq_lens[:nd, None]
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for s in range(nd, len(lens)):
            start, end, ctx = qs[s], qs[s + 1], lens[s]
            slots = _context_slots(meta.block_tables[s:s + 1], ctx, bs)[0]
            k = _gather(k_cache, slots).transpose(0, 1)  # [kv_heads, ctx, D]
            v = _gather(v_cache, slots).transpose(0, 1)
            qp = q[start:end].transpose(0, 1)  # [heads, n, D]
            n = end - start
            if n == ctx:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:  # the queries are the context's last n positions
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out


def _context_slots(tables: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    n = tables.shape[0]
    offsets = torch.arange(block_size, device=tables.device)
    return (tables.long()[:, :, None] * block_size + offsets).view(n, -1)[:, :width]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # index_select on rows is several times faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The fastest attention that works here: the native kernel on CPU, SDPA elsewhere."""
    if (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and kernels.native_library() is not None):
        return NativeCPUAttention()
    return TorchSDPAAttention()


@dataclass(slots=True)
class _ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    metadata: AttentionMetadata
    backend: object


_context: _ForwardContext | None = None


@contextlib.contextmanager
def forward_context(kv_caches, metadata: AttentionMetadata, backend):
    global _context
    _context = _ForwardContext(kv_caches, metadata, backend)
    try:
        yield
    finally:
        _context = None


@torch.library.custom_op("tritone::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, D]; k, v: [num_tokens, kv_heads, D]; layer: the layer's index as a
    0-d tensor, an input rather than a constant, so that one compiled graph serves every layer.
    Returns [num_tokens, heads, D]."""
    ctx = _context
    k_cache, v_cache = ctx.kv_caches[int(layer)]
    slots = ctx.metadata.slot_mapping
    k_cache.view(k_cache.shape[0], -1).index_copy_(0, slots, k.reshape(len(slots), -1).to(k_cache.dtype))
    v_cache.view(v_cache.shape[0], -1).index_copy_(0, slots, v.reshape(len(slots), -1).to(v_cache.dtype))
    return ctx.backend.forward(q, k_cache, v_cache, ctx.metadata, scale)


@paged_attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)
