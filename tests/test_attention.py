"""The native paged-attention kernel against torch's SDPA over the same paged cache: decodes,
whole prompts, later prompt chunks and tails after prefix hits, in one packed batch."""

import pytest
import torch

from tritone.executor import kernels
from tritone.executor.attention import AttentionMetadata, NativeCPUAttention, TorchSDPAAttention


def test_kernel_builds():
    assert kernels.native_library() is not None, "the native kernel did not build: is a C compiler on PATH?"


def packed_batch(gen, heads, kv_heads, dim, dtype, block_size=4):
    # (query tokens, context length): two decodes, a whole prompt, a later chunk, a one-token
    # tail after a prefix hit, a prompt longer than the kernel's query tile, decodes whose
    # contexts fill and overrun the decode kernel's groups of eight keys, and a prompt and a
    # later chunk whose contexts span several of the prompt path's blocks of 64 keys.
    layout = [(1, 9), (1, 1), (6, 6), (5, 23), (1, 17), (37, 40), (1, 133), (1, 64), (1, 8), (70, 70), (20, 150)]
    num_blocks = sum(-(-ctx // block_size) for _, ctx in layout) + 5
    max_blocks = max(-(-ctx // block_size) for _, ctx in layout)
    # Blocks scattered over the cache, as after many requests came and went.
    order = torch.randperm(num_blocks, generator=gen).int()
    tables, used = torch.zeros(len(layout), max_blocks, dtype=torch.int32), 0
    for i, (_, ctx) in enumerate(layout):
        n = -(-ctx // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    query_start = torch.tensor([0] + [q for q, _ in layout], dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([ctx for _, ctx in layout], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=None, block_tables=tables, query_start=query_start, seq_lens=seq_lens,
                             query_start_list=query_start.tolist(), seq_lens_list=seq_lens.tolist(),
                             num_decodes=2, block_size=block_size)
    k_cache = torch.randn(num_blocks * block_size + 1, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size + 1, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(int(query_start[-1]), heads, dim, generator=gen)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 48)])
def test_kernel_matches_sdpa(dtype, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k_cache, v_cache, meta = packed_batch(gen, heads, kv_heads, dim, dtype)
    got = NativeCPUAttention().forward(q, k_cache, v_cache, meta, dim ** -0.5)
    want = TorchSDPAAttention().forward(q, k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


AMX = pytest.mark.skipif(not kernels.amx_attention_supported(9, 3, 64, 16),
                         reason="this CPU has no AMX (or the kernel may not use its tiles): the AMX path is not built")


@AMX
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 96), (32, 2, 64)])
def test_amx_kernel_matches_sdpa_of_the_bf16_queries(heads, kv_heads, dim):
    # The tiles take the queries in bf16: against SDPA of those rounded queries only the float32
    # sums' order differs. Groups of 3, 1, 8 and 16 heads; 96 and 128 take three and four tiles a
    # key row.
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k_cache, v_cache, meta = packed_batch(gen, heads, kv_heads, dim, torch.bfloat16, block_size=16)
    got = torch.zeros_like(q)
    kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens, 16,
                            dim ** -0.5, got, amx=True)
    want = TorchSDPAAttention().forward(q.bfloat16().float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_amx_kernel_refuses_what_it_cannot_run():
    q = torch.zeros(1, 4, 64)
    one = torch.ones(1, dtype=torch.int32)
    for cache, block_size in ((torch.zeros(4, 2, 64, dtype=torch.bfloat16), 4), (torch.zeros(16, 2, 64), 16)):
        with pytest.raises(ValueError, match="AMX"):
            kernels.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                    torch.tensor([0, 1], dtype=torch.int32), one, block_size, 1.0,
                                    torch.empty_like(q), amx=True)


def test_unsupported_head_size_is_refused():
    q = torch.zeros(1, 1, 12)
    cache = torch.zeros(4, 1, 12)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head sizes"):
        kernels.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32), one, 4, 1.0, torch.empty_like(q))


@pytest.mark.parametrize("dtype,amx,dim", [(dtype, False, dim) for dtype in (torch.float32, torch.bfloat16)
                                           for dim in (64, 48, 128)]
                         + [pytest.param(torch.bfloat16, True, dim, marks=AMX) for dim in (64, 128)])
@pytest.mark.parametrize("heads", [6, 10])
def test_a_tokens_attention_is_the_same_bits_as_a_decode_or_in_any_chunk(dtype, amx, dim, heads):
    # Seeded sampling depends on it: a prefix-cache hit, a chunked prompt or a batch changes which
    # path (decode or prompt tile) computes a token, never its result. Groups of 3 and of 5 query
    # heads: the bf16 kernel takes a group's heads up to four at a time.
    gen = torch.Generator().manual_seed(3)
    kv_heads, block_size, ctx = 2, 16, 150
    num_blocks = -(-ctx // block_size)
    table = torch.randperm(num_blocks, generator=gen).int()[None]
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(ctx, heads, dim, generator=gen)

    def attend(first: int, last: int) -> torch.Tensor:
        """Query tokens [first, last) as one chunk of the sequence."""
        out = torch.zeros(last - first, heads, dim)
        kernels.paged_attention(q[first:last].contiguous(), k_cache, v_cache, table,
                                torch.tensor([0, last - first], dtype=torch.int32),
                                torch.tensor([last], dtype=torch.int32), block_size, dim ** -0.5, out, amx=amx)
        return out

    whole = attend(0, ctx)
    for first, last in ((0, 1), (63, 64), (64, 65), (149, 150), (100, 101), (5, 70), (64, 150), (130, 150)):
        assert torch.equal(attend(first, last), whole[first:last]), (first, last)
