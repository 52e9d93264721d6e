"""The Llama family as Tritone's own model definition: Llama 2/3/3.x, Mistral, Qwen2/2.5 (QKV
bias), Qwen3 (q/k norm) and SmolLM, which differ only in the switches of `LlamaSpec`.

Flat layout: activations are [num_tokens, hidden] for the whole packed batch. One fused QKV GEMM
and one fused gate_up GEMM per layer; residual add fused into RMSNorm; a RoPE table computed once;
tied embeddings; logits only at the rows that are sampled. Linear weights are stored [in, out]
(see `Linear`). The arithmetic follows Hugging Face's modules operation for operation, so that
greedy answers in fp32 match theirs token for token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tritone.executor import gemm
from tritone.executor.attention import paged_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# RoPE types whose frequencies do not depend on the sequence length, so one table serves all.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True, frozen=True)
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def unsupported_reason(hf_config) -> str | None:
    """Why Tritone's own model cannot run this checkpoint (None: it can)."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        return f"architecture {archs[0] if archs else 'unknown'} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    rope = _rope_parameters(hf_config)
    if rope.get("rope_type", "default") not in _STATIC_ROPE_TYPES:
        return f"RoPE type {rope.get('rope_type')} changes with the sequence length"
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        return f"activation {hf_config.hidden_act} is not silu"
    return None


def spec_from_config(hf_config, max_model_len: int) -> LlamaSpec:
    arch = hf_config.architectures[0]
    heads = hf_config.num_attention_heads
    return LlamaSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_positions=max_model_len,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # configs written before transformers 5
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_table(hf_config, spec: LlamaSpec) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second, each as
    Hugging Face's rotary embedding computes them (frequencies from its own RoPE functions)."""
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] == "default":
        dim = spec.head_dim
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    freqs = torch.arange(spec.max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


class Linear(nn.Module):
    """A linear layer whose weight is stored [in, out], as MKL runs the small row counts of
    decode batches fastest; `prepack` adds the layout of the kernel chosen for this shape
    (gemm.py). Fused layers (QKV, gate_up) are one weight of concatenated columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("packed", None, persistent=False)  # the op's index of `packed_linear`
        self.packed_linear: gemm.PackedLinear | None = None
        # LoRA adapters stacked (lora.py): A [in, slots * width], B [slots * width, out], or None.
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_width = 0

    def prepack(self, choice: str) -> None:
        self.packed_linear, self.packed = gemm.pack(self.weight, choice)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        """`lora`: each token's one-hot adapter slot [tokens, slots] where adapters are loaded."""
        y = self._base(x)
        if lora is not None and self.lora_a is not None:
            mask = lora.repeat_interleave(self.lora_width, dim=1)
            y = y + torch.mm(torch.mm(x, self.lora_a) * mask, self.lora_b)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if torch.compiler.is_compiling():  # the op keeps the kernel call opaque to the graph
                return gemm.linear(x, self.weight, self.bias, self.packed)
            return self.packed_linear(x, self.bias)  # eager: without the op's dispatch
        return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalize in fp32, round to the input dtype, then scale, as Hugging Face
    does; `add_forward` fuses the residual add before it."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        x = x + residual
        return self(x), x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


AllReduce = Callable[[torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int, dtype: torch.dtype, all_reduce: AllReduce | None = None):
        super().__init__()
        # Tensor parallel: this rank's heads only, and o_proj's partial sums added over the ranks.
        self.all_reduce = all_reduce
        # On the CPU wherever the model is: the attention op reads it as a host int, which on a CUDA
        # tensor would be a device sync, forbidden inside a CUDA graph capture.
        self.register_buffer("layer_idx", torch.tensor(layer_idx, device="cpu"), persistent=False)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lora: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = paged_attention(q, k, v, self.layer_idx, self.scale)
        o = self.o_proj(o.reshape(n, self.q_size), lora)
        return o if self.all_reduce is None else self.all_reduce(o)


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, all_reduce: AllReduce | None = None):
        super().__init__()
        self.all_reduce = all_reduce
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, spec.mlp_bias, dtype)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias, dtype)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up, lora)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int, dtype: torch.dtype, all_reduce: AllReduce | None = None):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, dtype, all_reduce)
        self.mlp = MLP(spec, dtype, all_reduce)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, lora=None):
        """(this layer's output, the residual stream before it); the first layer gets a zero
        residual, so that every layer runs the same code and one compiled graph serves all.
        `lora`: each token's adapter slot, one-hot, where adapters are loaded (lora.py)."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, cos, sin, lora)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x, lora), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: LlamaSpec, rope: torch.Tensor, dtype: torch.dtype, vocab_range: tuple[int, int] | None = None,
                 all_reduce: AllReduce | None = None):
        """`spec`: the model, or under tensor parallelism this rank's part of it
        (tensor_parallel.local_spec); `vocab_range`: (start, count) of the vocabulary whose
        embeddings this rank holds, and `all_reduce` what adds the ranks' partial sums."""
        super().__init__()
        self.spec = spec
        self.vocab_range, self.all_reduce = vocab_range, all_reduce
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, all_reduce) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        # Its own [hidden, vocab] copy even when tied: the logits GEMM is the largest of a decode
        # step, and it runs fastest in the same layout as the others.
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype)
        # The table is made on the host; the model's device is where its weights were created
        # (the caller's `with torch.device(...)`), and the forward indexes it with positions there.
        self.register_buffer("rope", rope.to(self.embed_tokens.weight.device), persistent=False)
        # The decoder layer's forward, replaced by its compiled form (see compiler.py).
        self.layer_forward = DecoderLayer.forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                lora: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_indices: [num_sampled] rows to compute
        logits at; lora: each token's adapter slot, one-hot [num_tokens, slots] (None: no
        adapters loaded). Returns [num_sampled, vocab] float32 (this rank's slice of the
        vocabulary, padded, under tensor parallelism)."""
        return self.compute_logits(self.hidden_states(input_ids, positions, logits_indices, lora))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 logits of final hidden states: apart, so that CUDA graphs capture
        up to the hidden states and the logits of only the rows that sample are computed."""
        return self.lm_head(hidden).float()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                      lora: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed hidden states [num_sampled, hidden] at `logits_indices`."""
        x = self.embed(input_ids)
        table = self.rope[positions]  # [num_tokens, head_dim]
        half = table.shape[-1] // 2
        cos = torch.cat([table[:, :half], table[:, :half]], dim=-1).to(x.dtype)[:, None, :]
        sin = torch.cat([table[:, half:], table[:, half:]], dim=-1).to(x.dtype)[:, None, :]
        residual = torch.zeros_like(x)
        layer_forward = self.layer_forward
        if layer_forward is not DecoderLayer.forward and x.shape[0] > 1:
            # The compiled layer is traced with the token count symbolic, and nothing else; a lone
            # token runs the same graph (guards are dropped), so that a row's arithmetic never
            # depends on how many rows the step has (docs/contract.md, seeds).
            for t in (x, residual, cos, sin) + (() if lora is None else (lora,)):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=1 << 20)
        for layer in self.layers:
            if lora is None:
                x, residual = layer_forward(layer, x, residual, cos, sin)
            else:
                x, residual = layer_forward(layer, x, residual, cos, sin, lora)
        x = (x + residual)[logits_indices]
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_range is None:
            return self.embed_tokens(input_ids)
        start, count = self.vocab_range
        local = input_ids - start
        outside = (local < 0) | (local >= count)
        x = self.embed_tokens(local.clamp(0, count - 1)).masked_fill(outside[:, None], 0)
        return self.all_reduce(x)


def use_plain_linears(model: nn.Module) -> None:
    """Every linear on torch.mm, as the model loaded."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed_linear, m.packed = None, None


@contextlib.contextmanager
def reference_mode(model: LlamaForCausalLM):
    """The model as the reference that fast paths are checked against (verify.py): eager layers
    on torch.mm; what was set up is restored after."""
    linears = [(m, m.packed_linear, m.packed) for m in model.modules() if isinstance(m, Linear)]
    layer_forward = model.layer_forward
    use_plain_linears(model)
    model.layer_forward = DecoderLayer.forward
    try:
        yield
    finally:
        model.layer_forward = layer_forward
        for m, packed_linear, packed in linears:
            m.packed_linear, m.packed = packed_linear, packed
