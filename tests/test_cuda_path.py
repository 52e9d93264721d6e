"""The CUDA path's parts that a CPU can check: the Triton paged-attention kernel, run by Triton's
interpreter, against SDPA; the probe that picks a CUDA attention backend; and decode steps through
the CUDA-graph buffers with their padding (everything but the capture), end to end through the
engine against Hugging Face."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from test_attention import packed_batch
from test_executor import build_tiny, hf_greedy, prompts, MAX_TOKENS
from tritone.config import EngineConfig
from tritone.engine.core import LLMEngine
from tritone.executor import attention, cuda_graphs
from tritone.executor.attention import TorchSDPAAttention, TritonPagedAttention
from tritone.scheduling.request import SamplingParams

# conftest turns Triton's interpreter on where there is no GPU; with one, the kernel runs on it.
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 48)])
def test_triton_kernel_matches_sdpa(dtype, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k_cache, v_cache, meta = packed_batch(gen, heads, kv_heads, dim, dtype)
    meta.max_query_len = int((meta.query_start[1:] - meta.query_start[:-1]).max())
    q = q.to(dtype)
    on = lambda t: t.to(DEVICE)
    device_meta = dataclasses.replace(meta, block_tables=on(meta.block_tables), query_start=on(meta.query_start),
                                      seq_lens=on(meta.seq_lens))
    got = TritonPagedAttention().forward(on(q), on(k_cache), on(v_cache), device_meta, dim ** -0.5).cpu()
    assert got.dtype == dtype and got.shape == q.shape
    want = TorchSDPAAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tolerance)


class _Zeros:
    name = "zeros"

    def forward(self, q, k_cache, v_cache, meta, scale):
        return torch.zeros_like(q)


class _Raises:
    name = "raises"

    def forward(self, q, k_cache, v_cache, meta, scale):
        raise RuntimeError("Paged KV cache block size must be divisible by 256\nmore detail")


def test_probe_accepts_a_correct_kernel_and_says_why_it_passes_over_others():
    cpu = torch.device("cpu")
    assert attention.probe(TritonPagedAttention(), DEVICE, torch.float32, 8, 2, 64, 16) is None
    assert attention.probe(TritonPagedAttention(), DEVICE, torch.bfloat16, 6, 3, 80, 5) is None
    assert "differs from SDPA" in attention.probe(_Zeros(), cpu, torch.float32, 8, 2, 64, 16)
    assert attention.probe(_Raises(), cpu, torch.float32, 8, 2, 64, 16) == \
        "RuntimeError: Paged KV cache block size must be divisible by 256"


def test_attention_named_in_the_config_is_used():
    cpu = torch.device("cpu")
    assert attention.select_backend(cpu, torch.float32, 8, 2, 64, 16).name == "cpu-native"
    assert attention.select_backend(cpu, torch.float32, 8, 2, 64, 16, "triton").name == "triton"
    with pytest.raises(ValueError, match="attention must be"):
        EngineConfig(model="m", attention="flash")


def test_graph_sizes():
    assert cuda_graphs.graph_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert cuda_graphs.graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cuda_graphs.graph_sizes(8) == [1, 2, 4, 8]
    assert cuda_graphs.graph_sizes(1) == [1]


@pytest.mark.parametrize("name", ["qwen2", "llama3"])
def test_decode_steps_through_graph_buffers_equal_hugging_face(name, tmp_path):
    """The torch model with the Triton kernel, its decode steps through the graphs' static
    buffers: three requests padded to the graph of four, then two (a request ends early),
    and prompt chunks eagerly in between."""
    _, path, hf = build_tiny(name, tmp_path)
    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE.type, dtype="float32", kv_cache_bytes=8 << 20,
                                    block_size=4, max_num_batched_tokens=32, max_num_seqs=8, forward="torch",
                                    compile="off", attention="triton"))
    runner = engine.runner
    assert runner.attention.name == "triton"
    # Captured where there is a GPU; on CPU, the same buffers and padding without the capture.
    assert (runner.graphs is not None) == (DEVICE.type == "cuda")
    runner.graphs = runner.decode_graphs(8, capture=DEVICE.type == "cuda")
    sizes_run = []
    run = runner.graphs.run

    def counting_run(ids, *args):
        sizes_run.append(len(ids))
        return run(ids, *args)

    runner.graphs.run = counting_run
    ids = prompts(3)
    lengths = [MAX_TOKENS, MAX_TOKENS, 3]
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, SamplingParams(max_tokens=lengths[i], end_id=-1))
    got = {str(i): [] for i in range(len(ids))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert 3 in sizes_run and 2 in sizes_run, sizes_run
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The padding rows wrote only the spare slot: the cache's real blocks hold what the
    # requests wrote, so the outputs equal Hugging Face's.
    for i, p in enumerate(ids):
        assert got[str(i)] == hf_greedy(hf, p)[:lengths[i]]
