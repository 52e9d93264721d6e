"""Paged attention for CUDA as one Triton kernel: decodes, prompt chunks and tails after prefix
hits in one packed batch, read in place from the paged cache through block tables.

Each program takes one sequence, one tile of its query tokens and one KV head, and holds the
tile's tokens times the head's query heads as the rows of one matrix, so that a decode's grouped
query heads fill a tensor-core tile. It walks the context in tiles of keys, each key's slot
looked up in the block table (any block size works), with an online softmax. The grid depends
only on the number of sequences and the longest query, so that a decode batch of fixed size is
captured once in a CUDA graph and replayed with new lengths and tables.

Triton compiles it on first use. Under TRITON_INTERPRET=1 it runs on CPU tensors, which is how
the tests check it on machines without a GPU (in float32 arithmetic there, see _INTERPRETED).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The interpreter's tl.dot misreads bfloat16 and float16 operands (it multiplies their bits), so
# interpreted runs compute in float32: the kernel's indexing, masking and softmax are what they
# check, not the tensor-core product.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, query_start_ptr, seq_lens_ptr,
    scale, table_stride, q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, o_stride_t, o_stride_h,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # the new tokens are the context's last q_len positions

    r = tl.arange(0, ROWS)
    tok = tile * BLOCK_M + r // GROUP_P
    g = r % GROUP_P
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_begin + tok).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = first_pos + tok
    # Keys up to the tile's last token; none for a tile past the sequence's queries (the grid
    # covers the batch's longest query).
    kv_end = tl.minimum(seq_len, first_pos + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)

    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + n
        k_ok = k_pos < kv_end
        block = tl.load(tables_ptr + seq * table_stride + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        kv_off = slot[:, None] * kv_stride_s + kv_head * kv_stride_h + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    # Every query row sees at least key 0, so l > 0 wherever the store is unmasked.
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_begin + tok).to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_query_len: int,
                    scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, D]; caches: [num_slots, kv_heads, D] (slot = block * block_size +
    offset); block_tables: [num_seqs, max_blocks] int32; query_start: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32; max_query_len: the longest query (host int, sizes the grid).
    Returns [num_tokens, heads, D] in q's dtype."""
    num_tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    # Rows of query tokens x query heads per program: at least 16 for tl.dot; more for prompts,
    # whose tiles then share each key tile among more queries.
    block_m = max(1, (64 if max_query_len > 1 else 16) // group_p)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_m), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, seq_lens,
        scale, block_tables.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, ROWS=block_m * group_p,
        BLOCK_N=32 if q.dtype == torch.float32 else 64, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        IEEE=q.dtype == torch.float32 or _INTERPRETED, UPCAST=_INTERPRETED,
    )
    return out
