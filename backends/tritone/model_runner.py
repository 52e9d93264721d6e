"""Runs a Hugging Face causal LM over a packed batch with the engine's paged KV cache."""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tritone import attention, kernels, layers
from tritone.config import EngineConfig, resolve_device, resolve_dtype
from tritone.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    text_config = hf_config.get_text_config()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return 2 * text_config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) - 1))
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=self.dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
        ).to(self.device).eval()
        if self.device.type == "cpu":
            layers.transpose_linears(self.model)
            layers.fuse_rms_norms(self.model)
        text_config = self.hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = config.max_model_len or text_config.max_position_embeddings
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks(config)
        self.use_native_decode = kernels.is_supported(self.device, self.dtype)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        num_slots = self.num_blocks * self.block_size
        self.kv_caches = [
            (torch.zeros(num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=self.device),
             torch.zeros(num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=self.device))
            for _ in range(text_config.num_hidden_layers)
        ]
        logger.info("model %s on %s in %s, %d CPU threads; KV cache %d blocks of %d tokens", config.model,
                    self.device, self.dtype, torch.get_num_threads(), self.num_blocks, self.block_size)

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        per_block = kv_bytes_per_token(self.hf_config, self.dtype) * self.block_size
        budget = config.kv_cache_bytes or int(_available_bytes(self.device) * config.kv_cache_fraction)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(num_blocks)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Computes the scheduled tokens; returns logits [num_scheduled, vocab] at each
        request's last scheduled position (rows of unfinished prefill chunks are unused)."""
        input_ids, positions, last_index = [], [], []
        prefills, decodes, prefill_new_slots = [], [], []
        for item in batch.scheduled:
            req, start, n = item.request, item.request.num_computed_tokens, item.num_tokens
            first = len(input_ids)
            input_ids.extend(req.tokens_slice(start, start + n))
            positions.extend(range(start, start + n))
            last_index.append(len(input_ids) - 1)
            if n == 1:
                decodes.append((req.block_ids, start + 1))
            else:
                slots = self._slots(req.block_ids, start + n)
                prefills.append((first, n, slots))
                prefill_new_slots.append(slots[start:])
        tables = lengths = decode_slots = decode_mask = None
        new_slots = prefill_new_slots
        if decodes:
            tables, lengths, decode_new_slots = self._decode_tables(decodes)
            if not self.use_native_decode:
                decode_slots, decode_mask = self._padded_decode_slots(tables, lengths)
                tables = lengths = None
            # Decodes come first in the batch, so their new tokens' slots lead the mapping.
            new_slots = [decode_new_slots] + prefill_new_slots
        meta = attention.AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=torch.cat(new_slots),
            num_decodes=len(decodes),
            decode_block_tables=tables,
            decode_context_lens=lengths,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            block_size=self.block_size,
            prefills=prefills,
        )
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(last_index, device=self.device),
            tritone_metadata=meta,
        )
        return out.logits[0]

    def _slots(self, block_ids: list[int], context_len: int) -> torch.Tensor:
        """Cache slots of a request's first `context_len` tokens, in order."""
        blocks = torch.tensor(block_ids[: -(-context_len // self.block_size)])
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return slots[:context_len].to(self.device)

    def _decode_tables(self, decodes: list[tuple[list[int], int]]):
        """Block tables [num_decodes, max_blocks] and context lengths [num_decodes] (int32, on
        the device), and each new token's slot, with tensor ops (no per-token Python work)."""
        bs = self.block_size
        num_blocks = max(-(-ctx // bs) for _, ctx in decodes)
        table = torch.zeros(len(decodes), num_blocks, dtype=torch.int32)
        for i, (block_ids, ctx) in enumerate(decodes):
            row = block_ids[: -(-ctx // bs)]
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        lengths = torch.tensor([ctx for _, ctx in decodes], dtype=torch.int32)
        last = (lengths - 1).long()
        new_slots = table[torch.arange(len(decodes)), last // bs].long() * bs + last % bs
        return table.to(self.device), lengths.to(self.device), new_slots.to(self.device)

    def _padded_decode_slots(self, table: torch.Tensor, lengths: torch.Tensor):
        """Every decode's context slots, padded to the longest [num_decodes, width], and a mask
        [num_decodes, 1, 1, width] of the real ones, for the gather-then-SDPA path."""
        bs, n = self.block_size, table.shape[0]
        width = int(lengths.max())
        slots = (table.long()[:, :, None] * bs + torch.arange(bs, device=table.device)).view(n, -1)[:, :width]
        mask = (torch.arange(width, device=table.device)[None, :] < lengths[:, None]).view(n, 1, 1, width)
        return slots, mask
