"""Tritone's bf16 GEMM on AMX tiles (csrc/gemm.c, panel_rows_amx): the product of the rounded
operands, each row's bits whatever rows share the call, and the argmax of what it would write.
Skipped only where the CPU has no AMX (or the kernel denies the process its tiles)."""

import pytest
import torch

from tritone.executor import gemm, kernels

needs_amx = pytest.mark.skipif(not kernels.amx_gemm_supported(),
                               reason="this CPU has no AMX-BF16 (or Linux denied this process the AMX tiles)")


@needs_amx
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (7, 64, 70), (17, 1536, 576), (33, 576, 1536),
                                      (300, 64, 5003), (45, 40, 33)])
def test_amx_gemm_equals_the_product_of_the_rounded_operands(rows, k, n):
    # Rows under, at and over a tile's 16 and a block's 32, and several blocks of rows; a partial last
    # panel; k = 40 is not whole tiles, so AVX512-BF16's kernel serves it.
    gen = torch.Generator().manual_seed(rows)
    weight, x, bias = torch.randn(k, n, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_bf16(weight)
    want = x.bfloat16().float() @ weight.bfloat16().float()
    torch.testing.assert_close(kernels.gemm_bf16_amx(x, panels, bias, n), want + bias, rtol=1e-4, atol=2e-4)
    got = kernels.gemm_bf16_amx(x, panels, None, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
    assert torch.equal(kernels.gemm_bf16_amx_argmax(x, panels, n), got.argmax(dim=-1))


@needs_amx
def test_amx_gemm_gives_a_row_the_same_bits_at_any_row_count():
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(576, 1536, generator=gen), torch.randn(70, 576, generator=gen)
    panels = kernels.pack_bf16(weight)
    whole = kernels.gemm_bf16_amx(x, panels, None, 1536)
    for first, last in ((0, 1), (3, 4), (0, 16), (5, 20), (0, 31), (0, 33), (16, 17), (39, 70)):
        assert torch.equal(kernels.gemm_bf16_amx(x[first:last].contiguous(), panels, None, 1536), whole[first:last])


@needs_amx
def test_amx_is_a_candidate_that_passes_the_start_up_check():
    assert "amx" in gemm.available(torch.bfloat16)
    assert "amx" not in gemm.available(torch.float32)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert gemm.check(gemm.PackedLinear(weight, "amx"), torch.bfloat16, torch.Generator().manual_seed(1)) is None


def test_without_amx_the_choice_falls_back_and_asking_for_it_is_refused(monkeypatch):
    """On a CPU without AMX (simulated here where there is one) the kernel is never a candidate, and
    --gemm amx names the flag."""
    monkeypatch.setattr(kernels, "amx_gemm_supported", lambda: False)
    assert "amx" not in gemm.available(torch.bfloat16)
    with pytest.raises(ValueError, match="--gemm amx: does not run bfloat16 here"):
        gemm.choose({(64, 96)}, torch.bfloat16, None, only="amx")
    # torch.mm on blocks of 32 rows, padded or not, whichever passes the row-invariance check here
    assert gemm.choose({(64, 96)}, torch.float32, None, only="mm")[(64, 96)].startswith("mm/32")
