"""Tritone's Llama-family model run by one native call per step (`csrc/llama.c`) on the CPU: fp32,
or bf16 where the CPU has AVX512-BF16 and the native bf16 GEMM measured fastest.

The torch path runs a step as about ten operations per layer from Python; compiled, it still
paid about half a millisecond per layer around the GEMMs and attention (dynamo's wrappers, the
custom ops' dispatch, allocations). The native forward runs the same kernels (gemm.c's GEMM,
paged_attention.c's attention) back to back in C on one scratch buffer, with the small work
between them fused by hand. It reads the weights of the `LlamaForCausalLM` module in place
(linears as gemm.c's panels), so that both paths share one loaded model.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

from tritone.executor import kernels, llama

logger = logging.getLogger(__name__)

# Mirrors of csrc/kernels.h's LlamaLayer, LlamaModel and LlamaBatch, field for field: ctypes cannot
# read the header, which is the source of truth. The tests compare their sizes with the
# library's (llama_struct_sizes).
_LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up",
                 "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")


class _Lora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("width", ctypes.c_int)]


_LORA_LINEARS = {"lora_qkv": ("self_attn", "qkv_proj"), "lora_o": ("self_attn", "o_proj"),
                 "lora_gate_up": ("mlp", "gate_up_proj"), "lora_down": ("mlp", "down_proj")}


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS] + [(name, _Lora) for name in _LORA_LINEARS]


_ALL_REDUCE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("num_layers", "hidden", "intermediate", "num_heads",
                                                   "num_kv_heads", "head_dim", "vocab", "bf16", "vocab_start",
                                                   "vocab_rows")] + [
        ("all_reduce", _ALL_REDUCE), ("all_reduce_ctx", ctypes.c_void_p), ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, ctypes.c_void_p) for name in ("embed", "rope", "final_norm", "lm_head")] + [
        ("layers", ctypes.POINTER(_Layer)), ("lora_slots", ctypes.c_int), ("lora_cols", ctypes.c_int),
        ("attention_amx", ctypes.c_int), ("fused_row_work", ctypes.c_int)]


class _Batch(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("ids", "positions", "slots", "logits_rows", "block_tables",
                                                      "query_start", "seq_lens")] + [
        (name, ctypes.c_int) for name in ("num_tokens", "num_seqs", "max_blocks", "block_size", "num_logits")] + [
        ("lora_mask", ctypes.c_void_p)]


def unsupported_reason(model, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the native forward cannot run this model here (None: it can)."""
    if device.type != "cpu":
        return f"it runs on the CPU, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if not isinstance(model, llama.LlamaForCausalLM):
        return "the model runs on Hugging Face's modules"
    if dtype == torch.bfloat16:
        if not kernels.bf16_gemm_supported():
            return "its bfloat16 GEMM needs a CPU with AVX512-BF16"
    spec = model.spec
    if spec.head_dim % 8 or spec.head_dim > 256:
        return f"head size {spec.head_dim} is not a multiple of 8 up to 256"
    if kernels.native_library() is None:
        return f"the native kernels did not build ({kernels.missing_reason()})"
    return None


def lora_reason(model, lora_slots: int) -> str | None:
    """Why the native forward cannot apply the model's LoRA adapters (None: it can): B's input goes
    through the buffer of the widest linear input."""
    spec = model.spec
    widest_in = max(spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size)
    cols = max((lora_slots * m.lora_width for m in model.modules() if isinstance(m, llama.Linear)), default=0)
    if cols > widest_in:
        return f"--max-loras x --max-lora-rank x 3 ({cols}) is over the model's widest layer input ({widest_in})"
    return None


def slower_reason(model, dtype: torch.dtype) -> str | None:
    """Why `--forward auto` leaves the native forward out though it can run (None: it does not):
    in bf16 its GEMM is Tritone's, which must have measured fastest here (gemm.py)."""
    chosen = model.layers[0].mlp.gate_up_proj.packed_linear
    if dtype == torch.bfloat16 and (chosen is None or chosen.kernel not in ("tritone", "amx")):
        return f"torch's bfloat16 GEMM ({chosen.choice if chosen else 'mm'}) measured faster than Tritone's here (gemm.py)"
    return None


def _all_reduce_buffer(all_reduce, views: dict, ctx, x, n: int) -> None:
    address = ctypes.addressof(x.contents)
    view = views.get((address, n))
    if view is None:
        if len(views) > 1024:  # a view per buffer and token count seen: bounded
            views.clear()
        view = views[(address, n)] = torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)
    all_reduce(view)


def _gemm_code(model) -> int:
    """The bf16 model's GEMM in the native forward: on AMX tiles (2) where the MLP's measured
    choice is "amx", else AVX512-BF16 (1)."""
    chosen = model.layers[0].mlp.gate_up_proj.packed_linear
    return 2 if chosen is not None and chosen.kernel == "amx" else 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeForward:
    """Runs `model` over a packed batch with one native call; the caches are the runner's."""

    def __init__(self, model: "llama.LlamaForCausalLM", kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, group=None, lora_slots: int = 0, attention_amx: bool = False,
                 fused_row_work: bool = True):
        """`group`: the tensor-parallel ranks' tensor_parallel.Group, whose all-reduce the model's is;
        `lora_slots`: the adapter slots of the linears' stacked LoRA weights (lora.py), 0 for none;
        `attention_amx`: attention on AMX tiles (kernels.paged_attention's `amx`); `fused_row_work`:
        SiLU(gate) * up applied by the gate_up GEMM and the attention's output rounded by the
        attention, as they write (the same bits as in passes of their own: csrc/kernels.h)."""
        lora_cols = 0
        self.lib = kernels.native_library()
        spec = model.spec
        bf16 = model.embed_tokens.weight.dtype == torch.bfloat16
        cache_dtype = torch.bfloat16 if bf16 else torch.float32
        self.block_size = block_size
        self.vocab_size = spec.vocab_size
        self._keep: list[torch.Tensor] = []  # tensors whose memory the structures point into
        layers = (_Layer * spec.num_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_caches[i]
            assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == cache_dtype
            # Norms and biases are read as float32 (copies, for a bf16 model: a few KB a layer).
            vectors = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                       "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                       "k_norm": attn.k_norm.weight if attn.k_norm is not None else None,
                       "qkv_bias": attn.qkv_proj.bias, "o_bias": attn.o_proj.bias,
                       "gate_up_bias": mlp.gate_up_proj.bias, "down_bias": mlp.down_proj.bias}
            fields = {name: None if t is None else t.float().contiguous() for name, t in vectors.items()}
            fields.update(qkv=self._panels(attn.qkv_proj), o=self._panels(attn.o_proj),
                          gate_up=self._panels(mlp.gate_up_proj), down=self._panels(mlp.down_proj),
                          k_cache=k_cache, v_cache=v_cache)
            for name, tensor in fields.items():
                if tensor is not None:
                    assert tensor.is_contiguous(), name
                    self._keep.append(tensor)
                setattr(layers[i], name, _ptr(tensor))
            for name, (parent, linear_name) in _LORA_LINEARS.items():
                linear = getattr(getattr(layer, parent), linear_name)
                if lora_slots and linear.lora_a is not None:
                    a, b = kernels.pack(linear.lora_a), kernels.pack(linear.lora_b)
                    self._keep += [a, b]
                    setattr(layers[i], name, _Lora(_ptr(a), _ptr(b), linear.lora_width))
                    lora_cols = max(lora_cols, lora_slots * linear.lora_width)
        self._layers = layers
        rope, final_norm = model.rope.float().contiguous(), model.norm.weight.float().contiguous()
        self._keep += [rope, model.embed_tokens.weight, final_norm]
        vocab_start, vocab_rows = model.vocab_range or (0, spec.vocab_size)
        # Tensor parallel: the C forward calls the group's native all-reduce (shared memory)
        # directly, or else calls back here, which runs the collective on a tensor over the C
        # buffer (one per buffer, kept).
        native_reduce = group.native_all_reduce() if group is not None else None
        reduce_ctx = None
        if model.all_reduce is None:
            self._all_reduce = _ALL_REDUCE()
        elif native_reduce is not None:
            self._all_reduce, reduce_ctx = _ALL_REDUCE(native_reduce[0]), native_reduce[1]
        else:
            self._all_reduce = _ALL_REDUCE(functools.partial(_all_reduce_buffer, model.all_reduce, {}))
        self.model = _Model(
            num_layers=spec.num_layers, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            vocab=spec.vocab_size, bf16=_gemm_code(model) if bf16 else 0, vocab_start=vocab_start, vocab_rows=vocab_rows,
            all_reduce=self._all_reduce, all_reduce_ctx=reduce_ctx, eps=spec.rms_norm_eps, scale=spec.head_dim ** -0.5,
            embed=_ptr(model.embed_tokens.weight), rope=_ptr(rope), final_norm=_ptr(final_norm),
            lm_head=_ptr(self._panels(model.lm_head)), layers=layers, lora_slots=lora_slots if lora_cols else 0,
            lora_cols=lora_cols, attention_amx=int(attention_amx), fused_row_work=int(fused_row_work))
        self._scratch = torch.empty(0, dtype=torch.float32)

    def _panels(self, linear: "llama.Linear") -> torch.Tensor:
        """The layer's weight in gemm.c's panels: the copy its chosen kernels already hold, or a
        new one where torch's kernels were measured faster for the torch path."""
        packed = linear.packed_linear
        panels = packed.panels if packed is not None and packed.panels is not None else kernels.pack(linear.weight)
        self._keep.append(panels)
        return panels

    def __call__(self, ids, positions, slots, tables, query_start, seq_lens, logits_indices,
                 greedy: bool = False, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The runner's model input (arrays, see ModelRunner.prepare); returns logits
        [len(logits_indices), vocab] float32, or where `greedy`, each row's greedy token
        [len(logits_indices)] int64 without the logits ever being written. `lora_mask`: each
        token's adapter slot, one-hot float32 [tokens, lora_slots] (lora.py), where adapters are
        loaded."""
        arrays = [np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(positions, dtype=np.int64),
                  np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(logits_indices, dtype=np.int64),
                  np.ascontiguousarray(tables, dtype=np.int32), np.ascontiguousarray(query_start, dtype=np.int32),
                  np.ascontiguousarray(seq_lens, dtype=np.int32)]
        num_tokens, num_logits = len(arrays[0]), len(arrays[3])
        batch = _Batch(*(a.ctypes.data for a in arrays), num_tokens=num_tokens, num_seqs=len(arrays[6]),
                       max_blocks=arrays[4].shape[1], block_size=self.block_size, num_logits=num_logits,
                       lora_mask=_ptr(lora_mask))
        need = self.lib.llama_scratch_floats(ctypes.byref(self.model), num_tokens)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        if greedy:
            out = torch.empty(num_logits, dtype=torch.int64)
            logits_ptr, ids_ptr = None, out.data_ptr()
        else:
            out = torch.empty(num_logits, self.vocab_size, dtype=torch.float32)
            logits_ptr, ids_ptr = out.data_ptr(), None
        rc = self.lib.llama_forward(ctypes.byref(self.model), ctypes.byref(batch), self._scratch.data_ptr(),
                                    logits_ptr, ids_ptr, torch.get_num_threads())
        if rc == -1:
            raise MemoryError("the native forward could not allocate its scratch space")
        if rc:
            raise RuntimeError(f"the native forward failed ({rc})")
        return out
