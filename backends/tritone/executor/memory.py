"""How much memory the KV cache gets, and a step's inputs: sized once, at start.

On a CPU the cache takes a share of the available RAM (--kv-cache-fraction); on a GPU, as vLLM
sizes it, what --gpu-memory-utilization of the device leaves once the weights are loaded and the
largest step has been profiled; --kv-cache-bytes, where given, on either.
"""

from __future__ import annotations

import logging
import os

import torch

from tritone.config import EngineConfig
from tritone.executor import attention, tensor_parallel
from tritone.executor.base import kv_head_shape

logger = logging.getLogger(__name__)


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    text_config = hf_config.get_text_config()
    num_kv_heads, head_dim = kv_head_shape(text_config)
    return 2 * text_config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def _available_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_block_bytes(config: EngineConfig, hf_config, dtype: torch.dtype,
                   shard: tensor_parallel.Shard | None = None) -> int:
    """One KV cache block of this rank: its KV heads' part of every layer."""
    text_config = hf_config.get_text_config()
    num_kv_heads, head_dim = kv_head_shape(text_config)
    if shard is not None:
        num_kv_heads = shard.kv_heads[1]
    return 2 * text_config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize * config.block_size


def num_kv_blocks(config: EngineConfig, hf_config, dtype: torch.dtype, device: torch.device,
                  shard: tensor_parallel.Shard | None = None, profiled_budget: int | None = None) -> int:
    """KV cache blocks that the budget holds. Under tensor parallelism each rank holds its KV heads'
    part of every block. kv_cache_bytes is the server's in all, split evenly over the ranks of
    every engine; else, on a GPU, what the profile left (`profiled_budget`, profile_kv_budget); on
    a CPU, kv_cache_fraction of the RAM that its ranks share."""
    ranks = config.tensor_parallel_size * config.data_parallel_size
    per_block = kv_block_bytes(config, hf_config, dtype, shard)
    if config.kv_cache_bytes:
        budget = config.kv_cache_bytes // ranks
    elif device.type == "cuda":
        budget = profiled_budget or 0
    else:
        budget = int(_available_ram() * config.kv_cache_fraction) // ranks
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
    return int(num_blocks)


def profile_kv_budget(model, device: torch.device, config: EngineConfig, hf_config, dtype: torch.dtype,
                      shard: tensor_parallel.Shard | None) -> int:
    """The KV cache's bytes on a GPU, as vLLM sizes it: with the weights loaded, one forward pass of
    the largest step (max_num_batched_tokens tokens) on a scratch cache, then
    gpu_memory_utilization of the device's total memory less the weights, the peak that step
    reached and what other processes hold. The graphs captured later live in what is left."""
    _, total = torch.cuda.mem_get_info(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    tokens = config.max_num_batched_tokens
    per_block = kv_block_bytes(config, hf_config, dtype, shard) // (2 * hf_config.get_text_config().num_hidden_layers)
    blocks = -(-tokens // config.block_size) + 1
    rows = blocks * config.block_size
    width = per_block // (dtype.itemsize * config.block_size)
    num_kv_heads = shard.kv_heads[1] if shard is not None else kv_head_shape(hf_config.get_text_config())[0]
    caches = [(torch.zeros(rows + 1, num_kv_heads, width // num_kv_heads, dtype=dtype, device=device),
               torch.zeros(rows + 1, num_kv_heads, width // num_kv_heads, dtype=dtype, device=device))
              for _ in range(hf_config.get_text_config().num_hidden_layers)]
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    positions = torch.arange(tokens, dtype=torch.int64, device=device)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.full((tokens,), rows, dtype=torch.int64, device=device),
        block_tables=torch.arange(blocks - 1, dtype=torch.int32, device=device)[None, :],
        query_start=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device), query_start_list=[0, tokens],
        seq_lens_list=[tokens], num_decodes=0, block_size=config.block_size, max_query_len=tokens,
        max_seq_len=tokens)
    with torch.inference_mode(), attention.forward_context(caches, meta, attention.TorchSDPAAttention()):
        model(ids, positions, torch.tensor([tokens - 1], device=device))
    torch.cuda.synchronize(device)
    scratch = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline - scratch
    del caches
    torch.cuda.empty_cache()
    free_now, _ = torch.cuda.mem_get_info(device)
    in_use = total - free_now  # weights, this process's context, and every other process's memory
    budget = int(total * config.gpu_memory_utilization) - in_use - max(0, activation_peak)
    logger.info("GPU memory: %.1f GiB total, %.1f GiB in use with the weights loaded, %.2f GiB peak activations "
                "at %d tokens; KV cache %.1f GiB (--gpu-memory-utilization %.2f)", total / 2**30, in_use / 2**30,
                activation_peak / 2**30, tokens, max(budget, 0) / 2**30, config.gpu_memory_utilization)
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {config.gpu_memory_utilization}: no memory is left for the KV "
                         f"cache ({in_use / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB after loading the weights)")
    return budget


def staging_bytes(config: EngineConfig, max_blocks: int) -> int:
    """A step's host arrays at most: ids, positions, slots and logits rows (int64) of every token,
    block tables (int32) and lengths of every sequence, and the pending tokens' places."""
    tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
    return 8 * (4 * tokens + 2 * seqs) + 4 * (seqs * max_blocks + 2 * seqs + 1) + 64 * 16
