"""Loads a checkpoint's safetensors (one file or shards) straight into Tritone's fused
parameters: q/k/v into the QKV weight's column slices, gate/up into gate_up's, each transposed
into the [in, out] layout and cast to the model's dtype on the way; under tensor parallelism, only
the rank's slice of each (tensor_parallel.shard_tensor)."""

from __future__ import annotations

import pathlib
import re

import torch
from safetensors import safe_open

from tritone.executor.llama import LlamaForCausalLM
from tritone.executor.tensor_parallel import Shard, shard_tensor

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Checkpoint name -> (our module path inside a layer, shard index in the fused parameter).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Buffers some checkpoints carry that the model computes itself.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors file")
    return files


def load_weights(model: LlamaForCausalLM, model_dir: str | pathlib.Path, shard: Shard | None = None) -> None:
    """Fills every parameter of `model` (this rank's part where `shard` is given); raises if the
    checkpoint lacks one or has extras."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    embed = None
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                tensor = f.get_tensor(name)
                if name == "model.embed_tokens.weight":
                    embed = tensor
                filled.add(_load_one(model, params, name, tensor, shard))
    if "lm_head.weight" not in filled:
        if not model.spec.tie_word_embeddings or embed is None:
            raise ValueError(f"{model_dir}: no lm_head.weight and the embeddings are not tied")
        filled.add(_load_one(model, params, "lm_head.weight", embed, shard))
    missing = set(params) - filled
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {sorted(missing)[:5]}")


def _load_one(model, params, name: str, tensor: torch.Tensor, rank_shard: Shard | None = None) -> str:
    """Copies one checkpoint tensor into its place; returns the parameter's name."""
    target_name, shard = _target(name)
    if target_name not in params:
        raise ValueError(f"checkpoint tensor {name} has no place in the model")
    param = params[target_name]
    if rank_shard is not None:
        tensor = shard_tensor(name, tensor, rank_shard, model.spec.head_dim)
    with torch.no_grad():
        if tensor is None:  # a bias another rank adds
            param.zero_()
        elif shard is None:
            src = tensor.t() if _is_linear_weight(target_name) else tensor
            param.copy_(src)
        else:
            _copy_shard(model, param, target_name, shard, tensor)
    return target_name


def _target(name: str) -> tuple[str, int | None]:
    if name.startswith("model.") and not _LAYER.match(name):
        return name[len("model."):], None  # embed_tokens, norm
    if name.startswith("lm_head."):
        return name, None
    match = _LAYER.match(name)
    if not match:
        return name, None
    layer, rest = match.groups()
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{rest}", None


def _is_linear_weight(name: str) -> bool:
    return name.endswith("proj.weight") or name == "lm_head.weight"


def _shard_sizes(model, name: str) -> list[int]:
    spec = model.spec
    if "qkv_proj" in name:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [q, kv, kv]
    return [spec.intermediate_size, spec.intermediate_size]


def _copy_shard(model, param: torch.Tensor, name: str, shard: int, tensor: torch.Tensor) -> None:
    sizes = _shard_sizes(model, name)
    start = sum(sizes[:shard])
    if name.endswith(".weight"):  # [in, out]: the shard is a block of columns
        param[:, start:start + sizes[shard]].copy_(tensor.t())
    else:
        param[start:start + sizes[shard]].copy_(tensor)


def random_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Fills every parameter with seeded random values in place, on the model's device: a model of
    any shape measured without a checkpoint on disk (`load_format` dummy, as vLLM's). Norms are 1,
    the rest small normals, so activations stay finite through any depth."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
