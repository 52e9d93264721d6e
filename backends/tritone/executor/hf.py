"""The fallback for architectures Tritone has no model definition of: Hugging Face's own module
code, run with the same paged attention op and the same forward signature as Tritone's models.

Only module objects change (faster CPU forms of linears and norms, swapped in after loading),
never the model's forward code, so this works for any causal LM that `transformers` ships.
"""

from __future__ import annotations

import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tritone.executor.attention import paged_attention

ATTN_IMPLEMENTATION = "tritone_paged"


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query: [1, heads, T, D]; key/value: [1, kv_heads, T, D] -> the op's flat [T, heads, D].
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1).contiguous(),
                          value[0].transpose(0, 1).contiguous(), torch.tensor(module.layer_idx), scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind Tritone's model signature."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION).to(device).eval()
        if device.type == "cpu":
            transpose_linears(self.model)
            fuse_rms_norms(self.model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=logits_indices)
        return out.logits[0].float()


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight stored as [in, out], the layout MKL runs decode-sized
    GEMMs fastest in; transposed once at load time."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        # Model code sometimes reads `.weight` for its dtype or device: a view, not a copy.
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.mm(flat, self.weight_t) if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        return out.view(*x.shape[:-1], self.out_features)


def transpose_linears(model: nn.Module) -> int:
    """Replaces every plain nn.Linear of `model` by a TransposedLinear; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, TransposedLinear(child))
    return len(targets)


class FusedRMSNorm(nn.Module):
    """Llama's RMSNorm as one fused op instead of seven: same arithmetic, in the same order
    (normalize in fp32, round to the input dtype, then scale)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def _forward_source(cls) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None


def fuse_rms_norms(model: nn.Module) -> int:
    """Replaces every norm whose forward is, word for word, Llama's RMSNorm forward (Llama,
    Qwen2/3, Mistral and many more copy it); others, such as Gemma's (1 + weight), stay."""
    reference = _forward_source(LlamaRMSNorm)
    same: dict[type, bool] = {}
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            cls = type(child)
            if cls not in same:
                same[cls] = hasattr(child, "variance_epsilon") and _forward_source(cls) == reference
            if same[cls]:
                targets.append((parent, name, child))
    for parent, name, child in targets:
        setattr(parent, name, FusedRMSNorm(child))
    return len(targets)
