"""Tritone's bf16 GEMM on AMX tiles (csrc/gemm.c, panel_rows_amx): the product of the rounded
operands, each row's bits whatever rows share the call, and the argmax of what it would write; and
the AMX attention's place among the CPU kernels (its arithmetic: test_attention.py). Skipped only
where the CPU has no AMX (or the kernel denies the process its tiles)."""

import logging
import re

import pytest
import torch

from test_attention import AMX as needs_amx_attention
from test_engine import make_engine
from tritone.executor import attention, gemm, kernels

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


@needs_amx_attention
def test_amx_attention_is_measured_against_the_vector_kernel(caplog):
    # `auto` times both after each passed its probe; which wins is this machine's fact, not the test's.
    with caplog.at_level(logging.INFO, logger="tritone.executor.attention"):
        chosen = attention.select_backend(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 16)
    assert chosen.name in ("cpu-native", "cpu-amx")
    assert re.search(r"attention cpu-(native|amx): the fastest here \(.*cpu-amx [\d.]+, cpu-native [\d.]+\)",
                     caplog.text), caplog.text
    assert attention.select_backend(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 16, "cpu-amx").name == "cpu-amx"


@needs_amx_attention
def test_the_native_forward_serves_with_amx_attention_and_passes_its_check(model_dir):
    # --forward native refuses to start where the forward fails its start-up check (verify.py).
    engine = make_engine(model_dir, dtype="bfloat16", attention="cpu-amx", forward="native")
    assert engine.runner.attention.name == "cpu-amx" and engine.runner.native.model.attention_amx == 1


def test_without_amx_attention_auto_keeps_the_vector_kernel_and_asking_for_it_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "amx_attention_supported", lambda *shape: False)
    assert attention.select_backend(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 16).name == "cpu-native"
    with pytest.raises(ValueError, match="--attention cpu-amx: needs a CPU with AMX"):
        attention.select_backend(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 16, "cpu-amx")
