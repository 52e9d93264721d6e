"""Decode steps replayed from CUDA graphs at fixed batch sizes.

A decode step of a large batch launches a few hundred kernels; on a GPU their launch costs as
much as their work at small batches. Each batch size in `graph_sizes` is captured once at start,
reading static input buffers (token ids, positions, slots, block tables, context lengths), and a
step of n decodes copies its inputs into the buffers' first n rows and replays the graph of the
smallest size that holds n. Padding rows attend one key of block 0, write their keys and values
to the spare slot that no block table names, and are dropped. A batch with a prompt chunk, or
larger than the largest size, runs eagerly. The graphs end at the final hidden states (as
nano-vllm's and vLLM's do): the logits of the rows that sample are computed after the replay,
so that no graph holds a [size, vocab] output (about 1 GB over every size at a 128k vocabulary).

With `capture=False` the same buffers and padding run eagerly: that is how the tests check, on
CPU, everything here but the capture itself.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from tritone.executor import attention
from tritone.executor.staging import HostStaging

logger = logging.getLogger(__name__)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, backend, block_size: int, max_model_len: int,
                 spare_slot: int, sizes: list[int], device: torch.device, capture: bool = True):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.max_model_len, self.spare_slot = block_size, max_model_len, spare_slot
        self.sizes = sorted(sizes)
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), spare_slot, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture_all()

    def _run(self, size: int) -> torch.Tensor:
        meta = attention.AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.tables[:size], query_start=self.query_start[:size + 1],
            seq_lens=self.seq_lens[:size], query_start_list=[], seq_lens_list=[], num_decodes=size,
            block_size=self.block_size, max_query_len=1, max_seq_len=self.max_model_len)
        with attention.forward_context(self.kv_caches, meta, self.backend):
            return self.model.hidden_states(self.ids[:size], self.positions[:size], self.rows[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = None
        # Largest first, so that the smaller graphs fit in the memory pool the largest left.
        for size in reversed(self.sizes):
            # Outside the capture first: Triton compiles and cuBLAS picks its kernels here.
            self._run(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def fits(self, num_seqs: int, num_decodes: int, width: int) -> bool:
        return num_decodes == num_seqs and num_seqs <= self.sizes[-1] and width <= self.tables.shape[1]

    @torch.inference_mode()
    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
            seq_lens: np.ndarray, prev=None, staging: HostStaging | None = None) -> torch.Tensor:
        """Final hidden states [n, hidden] of a step of n decodes (one token per sequence); valid
        until the next call, which may overwrite them. `prev` as ModelRunner._forward's."""
        n = len(ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        staging = staging or HostStaging(self.ids.device, 0, pinned=False)
        staging.begin_step()
        host = staging.host
        self.ids[:n].copy_(host(ids), non_blocking=True)
        self.positions[:n].copy_(host(positions), non_blocking=True)
        self.slots[:n].copy_(host(slots), non_blocking=True)
        self.tables[:n, :tables.shape[1]].copy_(host(tables), non_blocking=True)
        self.seq_lens[:n].copy_(host(seq_lens), non_blocking=True)
        if prev is not None:
            device = self.ids.device
            self.ids[host(prev.dst).to(device, non_blocking=True)] = \
                prev.token_ids[host(prev.src).to(device, non_blocking=True)]
        staging.end_step()
        if size > n:
            self.ids[n:size] = 0
            self.positions[n:size] = 0
            self.slots[n:size] = self.spare_slot
            self.tables[n:size, 0] = 0
            self.seq_lens[n:size] = 1
        graph = self.graphs.get(size)
        if graph is None:
            return self._run(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
