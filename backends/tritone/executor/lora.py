"""LoRA adapters (PEFT checkpoints) over the base model: loaded once at start, applied per row.

For each linear, every adapter's A and B are stacked side by side into one [in, S * w] and one
[S * w, out] matrix (S slots, --max-loras; w: the linear's sub-projections times --max-lora-rank,
zero where an adapter's rank is lower or it leaves the projection out; its scale folded into B).
A step multiplies each token's input by the whole of A, keeps only its adapter's columns (a
one-hot mask of the token's slot) and multiplies by B: two thin GEMMs per linear whatever mix of
adapters the batch holds, and shapes that do not change from step to step, so the compiled
forward takes them as they are. A base-model token's mask is zero, so its output gets exactly
+0: it is the base model's, bit for bit.

The fused layers take their sub-projections' adapters side by side: QKV's columns are q, k and v
(A's column blocks q, k, v, B block-diagonal), gate_up's are gate and up.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass, field

import numpy as np
import torch

from tritone.config import parse_lora_modules

logger = logging.getLogger(__name__)

FLAG = "--lora-modules"
# Tritone's fused linear -> the checkpoint's projections in its columns, in order.
SUB_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                   "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class Adapter:
    name: str
    rank: int
    scale: float
    # "layers.3.self_attn.q_proj" -> (A [rank, in], B [out, rank]), float32
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(name: str, path: str, max_rank: int) -> Adapter:
    """A PEFT LoRA checkpoint (adapter_config.json and adapter_model.safetensors); ValueError
    naming the flag and the adapter for anything it cannot apply."""
    from safetensors.torch import load_file

    where = f"{FLAG} {name}={path}"
    directory = pathlib.Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: no readable adapter_config.json ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: a {config.get('peft_type')} adapter, not LoRA")
    unsupported = [key for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern")
                   if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise ValueError(f"{where}: {', '.join(f'{k}={config[k]!r}' for k in unsupported)} is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    files = sorted(directory.glob("adapter_model*.safetensors"))
    if not files:
        raise ValueError(f"{where}: no adapter_model.safetensors")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    adapter = Adapter(name, rank, scale)
    known = {sub for subs in SUB_PROJECTIONS.values() for sub in subs}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"{where}: weight {key} is not a LoRA A or B")
            continue
        module = key.split(".lora_A.")[0]
        layers = module.find("layers.")
        projection = module.rsplit(".", 1)[-1]
        if layers < 0 or projection not in known:
            raise ValueError(f"{where}: adapts {module}, which is not a decoder layer's q/k/v/o or MLP projection")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{where}: {key} has no lora_B")
        adapter.weights[module[layers:]] = (a.float(), b.float())
    if not adapter.weights:
        raise ValueError(f"{where}: holds no LoRA weights")
    return adapter


class LoraWeights:
    """The adapters of a model, stacked per linear (see the module's docstring)."""

    def __init__(self, names: list[str], max_loras: int):
        self.names, self.max_loras = names, max_loras

    def mask(self, lora_ids: np.ndarray | None, q_lens: np.ndarray, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """[tokens, max_loras]: each token's one-hot adapter slot (adapter i in slot i - 1; the
        base model's tokens zero), for sequences of `q_lens` tokens with adapters `lora_ids`."""
        num_tokens = int(q_lens.sum())
        mask = np.zeros((num_tokens, self.max_loras), dtype=np.float32)
        if lora_ids is not None:
            per_token = np.repeat(np.asarray(lora_ids, dtype=np.int64), q_lens)
            rows = np.nonzero(per_token)[0]
            mask[rows, per_token[rows] - 1] = 1.0
        return torch.from_numpy(mask).to(device=device, dtype=dtype)


def attach(model, lora_modules: str, max_loras: int, max_rank: int) -> LoraWeights:
    """Loads the adapters of `lora_modules` (--lora-modules) and gives each of the model's decoder
    linears its stacked A and B."""
    modules = parse_lora_modules(lora_modules)
    if len(modules) > max_loras:
        raise ValueError(f"{FLAG}: {len(modules)} adapters, over --max-loras {max_loras}")
    adapters = [load_adapter(name, path, max_rank) for name, path in modules]
    spec, dtype = model.spec, model.embed_tokens.weight.dtype
    sizes = {"qkv_proj": (spec.num_heads * spec.head_dim,) + (spec.num_kv_heads * spec.head_dim,) * 2,
             "gate_up_proj": (spec.intermediate_size,) * 2}
    used = {key: False for adapter in adapters for key in adapter.weights}
    for i, layer in enumerate(model.layers):
        for linear_name, subs in SUB_PROJECTIONS.items():
            linear = getattr(getattr(layer, PARENT[linear_name]), linear_name)
            in_features, out_features = linear.weight.shape
            width = len(subs) * max_rank
            a_all = torch.zeros(in_features, max_loras * width)
            b_all = torch.zeros(max_loras * width, out_features)
            offsets = np.concatenate([[0], np.cumsum(sizes.get(linear_name, (out_features,)))])
            for slot, adapter in enumerate(adapters):
                for j, sub in enumerate(subs):
                    key = f"layers.{i}.{PARENT[linear_name]}.{sub}"
                    if key not in adapter.weights:
                        continue
                    a, b = adapter.weights[key]
                    out_sub = int(offsets[j + 1] - offsets[j])
                    if a.shape != (adapter.rank, in_features) or b.shape != (out_sub, adapter.rank):
                        raise ValueError(f"{FLAG} {adapter.name}: {key} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                         f"not ({adapter.rank}, {in_features}) and ({out_sub}, {adapter.rank})")
                    c = slot * width + j * max_rank
                    a_all[:, c:c + adapter.rank] = a.t()
                    b_all[c:c + adapter.rank, offsets[j]:offsets[j + 1]] = b.t() * adapter.scale
                    used[key] = True
            device = linear.weight.device
            linear.lora_a, linear.lora_b = a_all.to(device, dtype), b_all.to(device, dtype)
            linear.lora_width = width
    unused = [key for key, hit in used.items() if not hit]
    if unused:
        raise ValueError(f"{FLAG}: weights for modules the model does not have: {', '.join(unused[:3])}")
    logger.info("LoRA adapters: %s (at most %d, rank up to %d)",
                ", ".join(f"{a.name} (rank {a.rank}, {len(a.weights)} projections)" for a in adapters) or "none",
                max_loras, max_rank)
    return LoraWeights([a.name for a in adapters], max_loras)
