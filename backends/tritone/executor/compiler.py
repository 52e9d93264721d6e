"""Compiling the forward pass with torch.compile (inductor) on CPU.

The decoder layer is compiled once and its graph serves every layer: the layer's weights are
graph inputs, its index reaches the attention op as a tensor, and the token count is symbolic
(two or more; a lone token runs the eager layer, whose unpadded GEMV is fastest). That
takes seconds, where tracing all layers as one graph took minutes on these 2-core machines.
Inductor fuses the small ops around the GEMMs (RMSNorm with the residual add, RoPE, SiLU * up)
and removes the per-op Python of eager mode; the GEMMs and paged attention stay opaque ops
(gemm.py, attention.py). The compile cache lives under the Tritone cache directory, so a
restart loads the compiled code instead of compiling again.
"""

from __future__ import annotations

import locale
import logging
import os
import shutil
import types

import torch

logger = logging.getLogger(__name__)


def cache_dir():
    from tritone.cache import cache_root

    return cache_root() / "compile"


def should_compile(mode: str, device: torch.device) -> bool:
    """`on` and `auto` compile on CPU where a C++ compiler is present (`auto` says nothing when
    it is not; `on` logs why not); `off` never. On CUDA the forward runs eagerly (docs/architecture.md, The CUDA path)."""
    if mode == "off" or device.type != "cpu":
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        if mode == "on":
            logger.warning("--compile on: no C++ compiler found, serving the eager model")
        return False
    return True


_compiled: dict = {}


def _default_inductor_cache() -> None:
    """Puts inductor's cache under Tritone's unless the user chose one. Set when this module is
    imported: inductor writes its own default into the environment the first time anything asks
    it for its cache (loading the model does), after which this would come too late."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


_default_inductor_cache()


def compile_model(model: torch.nn.Module) -> bool:
    """Compiles the decoder layer's forward of Tritone's own model in place; False where the
    model is not one of ours or torch.compile cannot be set up (logged)."""
    from tritone.executor.llama import DecoderLayer, LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        logger.info("the Hugging Face fallback model runs eagerly")
        return False
    _use_utf8_locale()
    # One compile worker: the machine's other cores serve requests while a server starts.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        inductor_config.cpp.dynamic_threads = True
        # Round to the model's dtype wherever the eager forward (and Hugging Face's) rounds. By
        # default inductor keeps a fused bf16 kernel's intermediates in float32: another arithmetic
        # than the reference's, which on an Intel Xeon with AMX turned the default model's greedy
        # answer to "What is the capital of France?" from "The capital of France is Paris." into
        # "L'Étoile, la Marseillaise, ..." (the first token a near-tie: 0.08 apart in float32).
        inductor_config.emulate_precision_casts = True
        # LoRA's stacked weights are inputs of the graph too, of shapes it is traced with.
        adapters = model.layers[0].self_attn.qkv_proj.lora_a
        key = (model.spec, model.embed_tokens.weight.dtype, None if adapters is None else tuple(adapters.shape))
        if key not in _compiled:
            # Guards are dropped, as vLLM does: every call has the same dtypes and layouts, the
            # layer's weights are inputs, and the token count is symbolic, so the checks that
            # would run before each of the layers' calls could only pass. The compiled function
            # is shared only between models of one shape and dtype, and each gets a copy of the
            # function of its own, since dynamo keeps compiled code on the function's code object.
            _compiled[key] = torch.compile(_copy(DecoderLayer.forward, len(_compiled)), backend="inductor",
                                           fullgraph=True, dynamic=False,
                                           options={"guard_filter_fn": lambda guards: [False for _ in guards]})
        model.layer_forward = _compiled[key]
        return True
    except Exception as exc:
        logger.warning("torch.compile is unavailable, serving the eager model: %s", exc)
        return False


def _copy(fn, serial: int):
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{serial}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _use_utf8_locale() -> None:
    """Inductor reads and writes its generated sources with open()'s default encoding. Triton's
    Python backend stub embeds Python without setting the locale, so that default is ASCII there
    and the first non-ASCII byte fails the compile; UTF-8 is what Python itself uses by default."""
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
                return
            except locale.Error:
                continue


def is_compiled(model: torch.nn.Module) -> bool:
    from tritone.executor.llama import DecoderLayer

    return getattr(model, "layer_forward", DecoderLayer.forward) is not DecoderLayer.forward


def restore_eager(model: torch.nn.Module) -> None:
    from tritone.executor.llama import DecoderLayer

    model.layer_forward = DecoderLayer.forward
