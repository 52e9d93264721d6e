"""The fallback path's CPU layer rewrites compute what the modules they replace compute."""

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tritone.executor.hf import FusedRMSNorm, TransposedLinear, fuse_rms_norms, transpose_linears


def test_transposed_linear_matches_linear_with_and_without_bias():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8, bias=False))
    x = torch.randn(2, 5, 16)
    expected = model(x)
    assert transpose_linears(model) == 2
    assert isinstance(model[0], TransposedLinear) and model[0].weight.shape == (24, 16)
    torch.testing.assert_close(model(x), expected)


def test_only_llama_style_rms_norms_are_fused():
    norms = nn.ModuleList([LlamaRMSNorm(8, eps=1e-5), Qwen3RMSNorm(8), GemmaRMSNorm(8)])
    for norm in norms:
        nn.init.uniform_(norm.weight)
    x = torch.randn(3, 8) * 4
    expected = [norm(x) for norm in norms]
    assert fuse_rms_norms(norms) == 2
    # Gemma scales by (1 + weight): a different formula, left alone.
    assert [type(n) for n in norms] == [FusedRMSNorm, FusedRMSNorm, GemmaRMSNorm]
    for norm, want in zip(norms, expected):
        torch.testing.assert_close(norm(x), want, rtol=0, atol=0)


def test_fused_rms_norm_rounds_like_hugging_face_in_bf16():
    norm = LlamaRMSNorm(64).to(torch.bfloat16)
    nn.init.uniform_(norm.weight)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(FusedRMSNorm(norm)(x), norm(x), rtol=0, atol=0)
