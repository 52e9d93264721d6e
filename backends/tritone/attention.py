"""Paged attention over a packed, unpadded batch, plugged into Hugging Face model definitions.

The model runs with batch size 1 and every scheduled token side by side. Each attention layer
writes the new keys and values into the paged cache, then attends over each request's context,
read through its block table. One-token queries (decodes) are attended together in one padded
call; prompt chunks one request at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from tritone import kernels

ATTN_IMPLEMENTATION = "tritone_paged"


@dataclass(slots=True)
class AttentionMetadata:
    """Shared by every layer of one forward pass; built once per step by the model runner."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_slots, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V goes
    num_decodes: int  # the first num_decodes tokens are one-token queries
    # Decodes read the cache either in place through block tables (native CPU kernel) or from
    # a padded gather of their context slots (torch path); the other pair is None.
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    decode_slots: torch.Tensor | None  # [num_decodes, max_context]: context slots, padded
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context]: True where real
    block_size: int
    # Prefill chunks: (first query token, number of query tokens, context slots [context_len]).
    prefills: list[tuple[int, int, torch.Tensor]]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    tritone_metadata: AttentionMetadata = None, **kwargs):
    meta = tritone_metadata
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    # query: [1, heads, T, D]; key/value: [1, kv_heads, T, D]
    _write(k_cache, meta.slot_mapping, key[0].transpose(0, 1))
    _write(v_cache, meta.slot_mapping, value[0].transpose(0, 1))
    q = query[0]  # [heads, T, D]
    num_tokens = q.shape[1]
    out = q.new_empty(num_tokens, q.shape[0], q.shape[2])
    nd = meta.num_decodes
    if nd and meta.decode_block_tables is not None:
        qd = q[:, :nd].transpose(0, 1).float()  # [nd, heads, D]
        o = kernels.paged_decode_attention(qd, k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, meta.block_size,
                                           scaling if scaling is not None else q.shape[-1] ** -0.5)
        out[:nd] = o.to(out.dtype)
    elif nd:
        k = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [nd, kv_heads, ctx, D]
        v = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        qd = q[:, :nd].transpose(0, 1).unsqueeze(2)  # [nd, heads, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for start, length, slots in meta.prefills:
        k = _gather(k_cache, slots).transpose(0, 1)  # [kv_heads, ctx, D]
        v = _gather(v_cache, slots).transpose(0, 1)
        qp = q[:, start:start + length]
        ctx = slots.shape[0]
        if ctx == length:
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            # Queries are the last `length` positions of the context (prefix hit or later chunk).
            mask = torch.ones(length, ctx, dtype=torch.bool, device=q.device).tril(ctx - length)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[start:start + length] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def _write(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.view(cache.shape[0], -1).index_copy_(0, slots, values.reshape(len(slots), -1).to(cache.dtype))


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # index_select on rows is several times faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
