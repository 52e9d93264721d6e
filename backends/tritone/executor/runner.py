"""Runs the model over a packed batch with the engine's paged KV cache, and samples it.

`ModelRunner.prepare(batch, sample_rows)` turns the scheduler's output into flat token ids,
positions, a block table and a slot mapping (array work, one loop over the batch's requests);
`execute_model` sets the attention metadata, runs the model, computes logits only at the rows
that are sampled and samples them on the device (sampler.py), returning their token ids.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import torch

from tritone.config import EngineConfig
from tritone.executor import (attention, compiler, cuda_graphs, gemm, hardware, kernels, llama, lora, native,
                              tensor_parallel, verify)
from tritone.executor.base import RunnerBase, fallback_refused, kv_head_shape, model_shard
from tritone.executor.memory import num_kv_blocks, profile_kv_budget, staging_bytes
from tritone.executor.kernels import argmax_rows
from tritone.executor.loader import load_weights, random_weights
from tritone.executor.sampler import Sampler, needs_logits, score_prompt
from tritone.executor.sampling_state import SamplingTable
from tritone.executor.staging import HostStaging
from tritone.executor.step import PendingTokens, SamplingInput, StepHandle, StepInput

logger = logging.getLogger(__name__)


def build_model(model_dir: str, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                shard: tensor_parallel.Shard | None = None, all_reduce: llama.AllReduce | None = None,
                load_format: str = "auto", gemm_kernel: str = "auto"):
    """Tritone's own model where the architecture is covered (this rank's part of it under tensor
    parallelism), else Hugging Face's modules. `load_format` dummy: seeded random weights, nothing
    read; `gemm_kernel`: the CPU linears' kernel (auto: measured per shape)."""
    text_config = hf_config.get_text_config()
    reason = llama.unsupported_reason(text_config)
    if reason is None:
        spec = llama.spec_from_config(text_config, max_model_len)
        rope = llama.rope_table(text_config, spec)
        vocab_range = None
        if shard is not None and shard.size > 1:
            spec, vocab_range = tensor_parallel.local_spec(spec, shard), shard.vocab
        with torch.device(device):
            model = llama.LlamaForCausalLM(spec, rope, dtype, vocab_range, all_reduce if vocab_range else None)
        if load_format == "dummy":
            random_weights(model, seed=shard.rank if vocab_range else 0)
        else:
            load_weights(model, model_dir, shard if vocab_range else None)
        logger.info("model definition: Tritone's Llama family (%s)%s", text_config.architectures[0],
                    f", rank {shard.rank} of {shard.size}: KV heads {shard.kv_heads}, query heads {shard.q_heads}, "
                    f"MLP columns {shard.intermediate}, vocabulary {shard.vocab}" if vocab_range else "")
        if device.type == "cpu":
            prepack_linears(model, dtype, gemm_kernel)
        return model.eval()
    if shard is not None and shard.size > 1:
        raise fallback_refused(reason, shard.size)
    if load_format == "dummy":
        raise ValueError(f"--load-format dummy: covers Tritone's Llama family only, and this model runs on Hugging "
                         f"Face's modules ({reason})")
    from tritone.executor.hf import HFCausalLM

    logger.info("model definition: Hugging Face modules (%s)", reason)
    return HFCausalLM(model_dir, dtype, device)


def prepack_linears(model: torch.nn.Module, dtype: torch.dtype, kernel: str = "auto") -> None:
    """Gives every linear the kernel chosen for its shape (gemm.py: checked here, then fastest), or
    `kernel` where one is asked for (checked all the same)."""
    linears = [m for m in model.modules() if isinstance(m, llama.Linear)]
    choice = gemm.choose({tuple(m.weight.shape) for m in linears}, dtype, hardware.facts_path("linear"),
                         None if kernel == "auto" else kernel)
    for m in linears:
        m.prepack(choice[tuple(m.weight.shape)])


def _weights_stamp(model_dir: str) -> list:
    """The checkpoint's files by size and modification time: new weights are checked again."""
    import pathlib

    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in pathlib.Path(model_dir).glob("*.safetensors"))


class ModelRunner(RunnerBase):
    """The model on one device: the whole model, or one rank's part of it under tensor parallelism
    (`group`: the ranks' collectives; `num_blocks`: the KV blocks the ranks agreed on). The first
    rank samples; the others only join the forward's collectives."""

    def __init__(self, config: EngineConfig, group: tensor_parallel.Group | None = None, num_blocks: int = 0):
        super().__init__(config)
        self.device = hardware.resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        else:  # kernels, graphs and events go to the current device: make it ours, not GPU 0
            torch.cuda.set_device(self.device)
        self.dtype = hardware.resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        text_config = self.hf_config.get_text_config()
        self.group = group if group is not None and group.size > 1 else None
        shard = model_shard(self.hf_config, group.rank, group.size) if self.group is not None else None
        self.model = build_model(config.model, self.hf_config, self.dtype, self.device, self.max_model_len, shard,
                                 self.group.all_reduce if self.group is not None else None, config.load_format,
                                 config.gemm)
        if not num_blocks:
            budget = None
            if self.device.type == "cuda" and not config.kv_cache_bytes:
                budget = profile_kv_budget(self.model, self.device, config, self.hf_config, self.dtype, shard)
            num_blocks = num_kv_blocks(config, self.hf_config, self.dtype, self.device, shard, budget)
            if self.group is not None:  # every rank's cache has as many blocks as the smallest one holds
                num_blocks = self.group.min(num_blocks)
        self.num_blocks = num_blocks
        self.lora = self._load_adapters(config)
        num_kv_heads, head_dim = kv_head_shape(text_config)
        if shard is not None:
            num_kv_heads = shard.kv_heads[1]
        # One slot past the last block takes the keys and values of the warm-up's tokens.
        self.spare_slot = self.num_blocks * self.block_size
        # Its own pinned buffers (a step's sampling values, penalties' counts included).
        self.sampler, self.sampling = Sampler(HostStaging(self.device, 8 << 20)), SamplingTable()
        self.kv_caches = [
            (torch.zeros(self.spare_slot + 1, num_kv_heads, head_dim, dtype=self.dtype, device=self.device),
             torch.zeros(self.spare_slot + 1, num_kv_heads, head_dim, dtype=self.dtype, device=self.device))
            for _ in range(text_config.num_hidden_layers)
        ]
        num_heads = shard.q_heads[1] if shard is not None else text_config.num_attention_heads
        self.attention = attention.select_backend(self.device, self.dtype, num_heads, num_kv_heads, head_dim,
                                                  self.block_size, config.attention)
        logger.info("model %s on %s in %s, %d CPU threads, attention %s; KV cache %d blocks of %d tokens",
                    config.model, self.device, self.dtype, torch.get_num_threads(), self.attention.name,
                    self.num_blocks, self.block_size)
        self.compile_seconds = 0.0
        self.staging = HostStaging(self.device, staging_bytes(config, self.block_rows.table.shape[1]))
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        self._config = config
        # The start-up check of fast paths (verify.py) runs where one process holds the whole
        # model on the CPU; under tensor parallelism the ranks would have to check in lockstep.
        self._probe = None
        if self.device.type == "cpu" and self.group is None and isinstance(self.model, llama.LlamaForCausalLM):
            try:
                self._probe = verify.Probe(self.vocab_size, self.block_size, self.num_blocks)
            except ValueError as exc:
                logger.warning("fast paths: not checked at start (%s)", exc)
        elif isinstance(self.model, llama.LlamaForCausalLM):
            logger.info("fast paths: not checked at start (%s)", "tensor parallelism" if self.group else self.device.type)
        self.native = self._native_forward(config.forward)
        if self.native is None and self.group is not None and config.compile != "off":
            logger.info("torch.compile: off under tensor parallelism (the collectives run eagerly)")
        elif self.native is None and compiler.should_compile(config.compile, self.device):
            t0 = time.perf_counter()
            if compiler.compile_model(self.model):
                if self._warm_up() and self._passes("compiled forward", "--compile on" if config.compile == "on" else None):
                    self.compile_seconds = time.perf_counter() - t0
                    logger.info("compiled the forward pass in %.1f s (cache: %s)", self.compile_seconds,
                                compiler.cache_dir())
                else:
                    compiler.restore_eager(self.model)
        if self.native is None and not compiler.is_compiled(self.model) and self._probe is not None:
            if not self._passes("eager forward (Tritone's GEMMs and attention)", None):
                # Even the eager path on the chosen kernels is off: serve the reference itself.
                logger.warning("serving the reference forward (torch.mm and SDPA)")
                llama.use_plain_linears(self.model)
                self.attention = attention.TorchSDPAAttention()
        if self.device.type == "cuda" and config.cuda_graphs == "auto" and self.lora is None:
            self.graphs = self._capture_decode_graphs(config.max_num_seqs)
            if self.group is not None and self.group.min(int(self.graphs is not None)) == 0:
                # Replayed graphs hold the collectives: a rank stepping eagerly beside ranks that
                # replay would meet them in another order. All replay, or none does.
                if self.graphs is not None:
                    logger.warning("CUDA graphs: off, as another rank's capture failed")
                self.graphs = None

    def _load_adapters(self, config: EngineConfig) -> lora.LoraWeights | None:
        """The --lora-modules adapters on the model's linears (None where none are given)."""
        if not config.lora_modules:
            return None
        if not isinstance(self.model, llama.LlamaForCausalLM):
            raise ValueError(f"{lora.FLAG}: adapters apply to Tritone's Llama-family model, and this model runs on "
                             "Hugging Face's modules")
        if self.group is not None:
            raise ValueError(f"{lora.FLAG}: not yet under tensor parallelism (--tensor-parallel-size 1)")
        return lora.attach(self.model, config.lora_modules, config.max_loras, config.max_lora_rank)

    def decode_graphs(self, max_num_seqs: int, capture: bool = True) -> cuda_graphs.DecodeGraphs:
        return cuda_graphs.DecodeGraphs(self.model, self.kv_caches, self.attention, self.block_size,
                                        self.max_model_len, self.spare_slot, cuda_graphs.graph_sizes(max_num_seqs),
                                        self.device, capture)

    def _capture_decode_graphs(self, max_num_seqs: int) -> cuda_graphs.DecodeGraphs | None:
        """CUDA graphs of decode steps where the model and attention allow them (logged either way);
        a capture that fails leaves every step eager."""
        if not isinstance(self.model, llama.LlamaForCausalLM) or not self.attention.capturable:
            logger.info("CUDA graphs: off (%s)", "attention %s cannot be captured" % self.attention.name
                        if isinstance(self.model, llama.LlamaForCausalLM) else "the Hugging Face fallback model")
            return None
        try:
            graphs = self.decode_graphs(max_num_seqs)
        except Exception as exc:
            logger.warning("CUDA graph capture failed, every step runs eagerly: %s: %s", type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")
            torch.cuda.synchronize()
            return None
        logger.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s", len(graphs.sizes),
                    graphs.sizes[-1], graphs.capture_seconds)
        return graphs

    def _native_forward(self, mode: str) -> native.NativeForward | None:
        """The native forward where `mode` and the model allow it and it passes the start-up check
        (logged either way; `--forward native` refuses to start where it cannot serve)."""
        if mode == "torch":
            return None
        reason = native.unsupported_reason(self.model, self.dtype, self.device)
        if reason is None and self.lora is not None:
            reason = native.lora_reason(self.model, self.lora.max_loras)
        if reason is None and mode == "auto":
            reason = native.slower_reason(self.model, self.dtype)
        if reason is not None:
            if mode == "native":
                raise ValueError(f"--forward native: {reason}")
            logger.info("forward pass: torch (the native forward does not serve: %s)", reason)
            return None
        self.native = native.NativeForward(self.model, self.kv_caches, self.block_size, self.group,
                                           self.lora.max_loras if self.lora is not None else 0,
                                           attention_amx=self.attention.name == "cpu-amx")
        if self._probe is not None and not self._passes("native forward", "--forward native" if mode == "native" else None):
            self.native = None
            return None
        logger.info("forward pass: native, one call per step")
        return self.native

    def _passes(self, name: str, flag: str | None) -> bool:
        """Whether the forward as now set up agrees with the reference (verify.py); a path asked
        for by `flag` that does not refuses to start, naming the flag."""
        if self._probe is None:
            return True
        key = {"path": name, "model": self._config.model, "weights": _weights_stamp(self._config.model),
               "dtype": str(self.dtype), "attention": self.attention.name, "threads": torch.get_num_threads(),
               "gemm": sorted({m.packed_linear.choice for m in self.model.modules()
                               if isinstance(m, llama.Linear) and m.packed_linear is not None})}
        verdict = verify.cached_check(name, key, lambda: verify.check(
            lambda step: self._forward(step), self._reference_forward, self._probe, self.dtype))
        if verdict.problem is not None and flag is not None:
            raise ValueError(f"{flag}: the {name} disagrees with the eager reference here: {verdict.problem}")
        return verdict.problem is None

    @torch.inference_mode()
    def _reference_forward(self, step: StepInput) -> torch.Tensor:
        """The eager modules on torch.mm and SDPA in the serving dtype: what fast paths must match."""
        with llama.reference_mode(self.model):
            return self._torch_forward(step, None, attention.TorchSDPAAttention())

    def _warm_up(self) -> bool:
        """Runs the compiled model on batches of several sizes so that no request pays for
        compiling; a failure falls back to eager with one log line."""
        try:
            for num_tokens, num_seqs in ((16, 2), (3, 3), (64, 1)):
                self._forward(self._dummy_batch(num_tokens, num_seqs))
            return True
        except Exception as exc:  # any compiler fault: the eager model still serves
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            lines = [line for line in str(cause).splitlines() if line.strip()]
            logger.warning("torch.compile failed, serving the eager model: %s: %s", type(cause).__name__,
                           " / ".join(lines[:3])[:500])
            return False

    def _dummy_batch(self, num_tokens: int, num_seqs: int) -> StepInput:
        """num_seqs sequences sharing num_tokens query tokens, over block 0, writing nowhere."""
        q_lens = np.full(num_seqs, num_tokens // num_seqs)
        q_lens[-1] += num_tokens - q_lens.sum()
        query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        seq_lens = q_lens.astype(np.int32)
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        if max_blocks > self.num_blocks:
            raise ValueError("the KV cache is too small for the warm-up batch")
        tables = np.tile(np.arange(max_blocks, dtype=np.int32), (num_seqs, 1))
        ids = np.zeros(num_tokens, dtype=np.int64)
        positions = np.concatenate([np.arange(n) for n in q_lens]).astype(np.int64)
        slots = np.full(num_tokens, self.spare_slot, dtype=np.int64)
        return StepInput(ids, positions, slots, tables, query_start, seq_lens, query_start[1:] - 1, 0)

    @torch.inference_mode()  # the logits are inference tensors, and the sampler edits them
    def execute_model(self, step: StepInput, sampling: SamplingInput | None,
                      prev: PendingTokens | None = None) -> StepHandle:
        """Computes the scheduled tokens and samples the rows `sampling.sample_ids`: their token ids
        [rows] int64 (and log-probabilities where asked) on the device. A rank other than the first
        gets no `sampling`: it only joins the forward's collectives."""
        rows = self.sampling.begin_step(sampling) if sampling is not None else []
        num_scored = 0 if step.score_targets is None else len(step.score_targets)
        greedy = bool(rows) and not num_scored and not needs_logits(rows)
        out = self.run_model(step, greedy, prev)
        scores = None
        if out is not None and num_scored:
            scores = score_prompt(out[len(out) - num_scored:], step.score_targets, step.score_k)
            out = out[:len(out) - num_scored]
        if out is None or not rows:  # a following rank, or a step that only fills the cache (and scores)
            handle = self.finish_step(None, None, 0)
            handle.scores = scores
            return handle
        with kernels.pool_threads() if self.native is not None else contextlib.nullcontext():
            token_ids, log_probs, top = self.sampler.sample_step(out, rows, sampling, greedy)
        handle = self.finish_step(token_ids, log_probs, len(rows))
        handle.top, handle.scores = top, scores
        self.sampling.end_step(handle, rows)
        return handle

    def run_model(self, step: StepInput, greedy: bool = False, prev: PendingTokens | None = None) -> torch.Tensor | None:
        """The forward pass: logits [len(sample_rows), vocab] float32 at the last scheduled token of
        each sampled request, or where `greedy`, those rows' greedy tokens [len(sample_rows)] int64
        (the native forward then never writes the logits); None on a rank other than the first."""
        if self.group is not None:
            # Each rank's logits over its slice of the vocabulary, side by side on the first rank,
            # which samples (the others return None).
            logits = self.group.gather_columns(self._forward(step, prev))
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
            return argmax_rows(logits) if greedy else logits
        if greedy and self.native is not None:
            return self._forward(step, prev, greedy=True)
        logits = self._forward(step, prev)
        return argmax_rows(logits) if greedy else logits

    def finish_step(self, token_ids: torch.Tensor | None, log_probs: torch.Tensor | None, num_rows: int) -> StepHandle:
        return StepHandle(token_ids, log_probs, num_rows)

    @torch.inference_mode()
    def _forward(self, step: StepInput, prev: PendingTokens | None = None, greedy: bool = False) -> torch.Tensor:
        ids, positions, slots, tables = step.ids, step.positions, step.slots, step.tables
        query_start, seq_lens, logits_indices, num_decodes = step.query_start, step.seq_lens, step.logits_indices, \
            step.num_decodes
        if self.native is not None:
            if prev is not None:
                ids = prev.patch(ids)
            mask = None
            if self.lora is not None:
                mask = self.lora.mask(step.lora_ids, np.diff(query_start), torch.float32, self.device)
            return self.native(ids, positions, slots, tables, query_start, seq_lens, logits_indices, greedy, mask)
        if self.graphs is not None and self.graphs.fits(len(seq_lens), num_decodes, tables.shape[1]):
            hidden = self.graphs.run(ids, positions, slots, tables, seq_lens, prev, self.staging)
            if len(logits_indices) != len(ids):  # not every decode samples: only those rows' logits
                hidden = hidden[torch.from_numpy(np.asarray(logits_indices)).to(self.device)]
            return self.model.compute_logits(hidden)
        return self._torch_forward(step, prev, self.attention)

    def _torch_forward(self, step: StepInput, prev: PendingTokens | None, backend) -> torch.Tensor:
        ids, positions, slots, tables = step.ids, step.positions, step.slots, step.tables
        query_start, seq_lens, logits_indices = step.query_start, step.seq_lens, step.logits_indices
        to = self.staging.to_device
        self.staging.begin_step()
        meta = attention.AttentionMetadata(
            slot_mapping=to(slots), block_tables=to(tables), query_start=to(query_start), seq_lens=to(seq_lens),
            query_start_list=query_start.tolist(), seq_lens_list=seq_lens.tolist(), num_decodes=step.num_decodes,
            block_size=self.block_size, max_query_len=int(np.diff(query_start).max()),
            max_seq_len=int(seq_lens.max()))
        input_ids, pos, rows = to(ids), to(positions), to(logits_indices)
        if prev is not None:
            input_ids[to(prev.dst)] = prev.token_ids[to(prev.src)]
        self.staging.end_step()
        with attention.forward_context(self.kv_caches, meta, backend):
            if self.lora is None:
                return self.model(input_ids, pos, rows)
            # Every step, all-base ones too: one compiled graph.
            return self.model(input_ids, pos, rows, self.lora.mask(step.lora_ids, np.diff(query_start), self.dtype,
                                                                  self.device))
