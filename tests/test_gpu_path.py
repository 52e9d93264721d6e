"""The CUDA path's failures that a CPU can find: the model built under another device holds every
parameter and buffer there (the first CUDA forward once indexed a host RoPE table with device
positions)."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from tritone.executor import llama

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("config", [LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]),
                                    Qwen3Config(**COMMON, architectures=["Qwen3ForCausalLM"])], ids=["llama", "qwen3"])
def test_a_model_built_under_a_device_holds_everything_there(config):
    spec = llama.spec_from_config(config, 256)
    rope = llama.rope_table(config, spec)  # made on the host, as build_model does
    with torch.device("meta"):
        model = llama.LlamaForCausalLM(spec, rope, torch.float32)
    elsewhere = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    # A layer's index for the attention op stays on the host by design: read there, no device sync.
    assert [n for n in elsewhere if not n.endswith(".layer_idx")] == []
    with torch.device("meta"):
        positions = torch.arange(3)
    assert model.rope[positions].device.type == "meta"  # the forward's first indexing


def test_device_tensors_never_build_the_native_library(monkeypatch):
    """The CPU kernels' library is compiled on first use: a step on another device must not pay
    for it (nor fail where no compiler is installed)."""
    from tritone.executor import kernels

    def refuse():
        raise AssertionError("the native library was asked for")

    monkeypatch.setattr(kernels, "native_library", refuse)
    with torch.device("meta"):
        x, p = torch.zeros(3, 7), torch.full((3,), 0.9)
    assert kernels.argmax_rows(x).device.type == "meta"
    assert kernels.top_p_rows(x, p) is False


def test_flash_varlen_is_only_tried_at_blocks_it_can_read():
    from tritone.executor import attention

    with pytest.raises(ValueError, match=r"--attention flash-varlen: .*multiple of 256 .*--block-size 256"):
        attention.select_backend(torch.device("cpu"), torch.float32, 4, 2, 16, 16, "flash-varlen")
    assert not any(b.name == "flash-varlen" for b in attention._cuda_candidates(16))


def test_the_device_check_skips_each_section_without_a_gpu():
    """scripts/gpu_check on a machine without CUDA: every section SKIPPED, exit 0."""
    import pathlib
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: scripts/gpu_check runs for real there")
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    run = subprocess.run([sys.executable, str(script), "versions", "tensor_parallel"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["SKIPPED", "versions"], ["SKIPPED", "tensor_parallel"]]
    assert lines[-1].startswith("gpu_check: 0 passed, 0 failed, 2 skipped")


def test_staged_inputs_arrive_whole_step_after_step():
    """The pinned staging path, run on plain host memory: each step's arrays arrive as they were,
    with two buffers taken in turn, and a step larger than the buffers still arrives (copied the
    ordinary way)."""
    import numpy as np

    from tritone.executor.staging import HostStaging

    staging = HostStaging(torch.device("cpu"), 1024, pinned=True)
    rng = np.random.default_rng(0)
    for step in range(5):
        staging.begin_step()
        arrays = [rng.integers(0, 1 << 40, size=7), rng.integers(0, 99, size=(3, 5)).astype(np.int32),
                  np.arange(step + 1, dtype=np.int64)]
        got = [staging.to_device(a) for a in arrays]
        staging.end_step()
        for a, g in zip(arrays, got):
            assert np.array_equal(g.numpy(), a) and g.dtype == torch.from_numpy(a).dtype
    staging.begin_step()
    big = np.arange(1000, dtype=np.int64)
    assert np.array_equal(staging.to_device(big).numpy(), big)
