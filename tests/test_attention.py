"""The native decode-attention kernel against torch's SDPA over the same paged cache."""

import pytest
import torch
import torch.nn.functional as F

from tritone import kernels


def test_kernel_builds():
    assert kernels.native_library() is not None, "the native kernel did not build: is a C compiler on PATH?"


def reference(q, k_cache, v_cache, tables, lengths, block_size):
    outs = []
    for i, n in enumerate(lengths.tolist()):
        slots = (tables[i].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k = k_cache[slots].float().transpose(0, 1)  # [kv_heads, n, D]
        v = v_cache[slots].float().transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_sdpa(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block_size, num_blocks, dim = 4, 64, 32
    lengths = torch.tensor([1, 3, 4, 5, 17, 40], dtype=torch.int32)
    max_blocks = -(-int(lengths.max()) // block_size)
    # Blocks scattered over the cache, as after many requests came and went.
    tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_blocks].view(len(lengths), -1).int()
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size, dim ** -0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lengths, block_size),
                               rtol=1e-4, atol=1e-5)
