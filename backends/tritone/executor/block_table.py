"""The block tables of running requests, kept from step to step.

Each running request owns one row of a preallocated table while it runs; a step writes only the
blocks a request gained since the last one (usually none, or one), and the step's table is one
gather of its requests' rows. Rebuilt from the requests' block lists every step, the table cost
a Python slice and copy per request per step, growing with the context. A request that is new,
or lost its blocks to preemption since its row was written, gets its whole row rewritten.
"""

from __future__ import annotations

import numpy as np

from tritone.executor.step import StepInput
from tritone.scheduling.request import Request, RequestStatus


class BlockTableRows:
    def __init__(self, num_rows: int, width: int):
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.num_blocks = [0] * num_rows
        self.owner: list[Request | None] = [None] * num_rows
        # The owner's preemption count when its row was written: a preempted request's blocks
        # are all new.
        self.epoch = [0] * num_rows
        self.free = list(range(num_rows - 1, -1, -1))

    def row_of(self, request: Request) -> int:
        """The request's row, brought up to date with its block list."""
        row = request.block_table_row
        if row < 0 or self.owner[row] is not request or self.epoch[row] != request.num_preemptions:
            return self._assign(request)
        blocks = request.block_ids
        n = self.num_blocks[row]
        if len(blocks) > n:
            self.table[row, n:len(blocks)] = blocks[n:]
            self.num_blocks[row] = len(blocks)
        return row

    def _assign(self, request: Request) -> int:
        if not self.free:
            self._reclaim()
        row = self.free.pop()
        blocks = request.block_ids
        self.table[row, :len(blocks)] = blocks
        self.table[row, len(blocks):] = 0
        self.num_blocks[row] = len(blocks)
        self.owner[row] = request
        self.epoch[row] = request.num_preemptions
        request.block_table_row = row
        return row

    def _reclaim(self) -> None:
        """Frees the rows of requests that no longer run (finished, or waiting after preemption)."""
        for row, owner in enumerate(self.owner):
            if owner is not None and (owner.status != RequestStatus.RUNNING or owner.block_table_row != row
                                      or self.epoch[row] != owner.num_preemptions):
                self.owner[row] = None
                self.free.append(row)
        if not self.free:
            raise RuntimeError("more running requests than block-table rows")


def prepare_step(block_rows: BlockTableRows, block_size: int, batch, sample_rows: list[int]) -> StepInput:
    """A scheduled batch's model inputs as arrays: flat token ids, positions, a block table and a
    slot mapping (array work, one loop over the batch's requests), logits at `sample_rows`."""
    scheduled = batch.scheduled
    num_seqs = len(scheduled)
    starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), np.int64, num_seqs)
    q_lens = np.fromiter((s.num_tokens for s in scheduled), np.int64, num_seqs)
    seq_lens = starts + q_lens
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    bs = block_size
    max_blocks = int(-(-seq_lens.max() // bs))
    rows = np.empty(num_seqs, dtype=np.int64)
    row_of = block_rows.row_of
    ids = []
    num_decodes = 0
    lora_ids = None
    # The one loop over the batch's requests.
    for i, item in enumerate(scheduled):
        request, start = item.request, int(starts[i])
        ids.extend(request.tokens_slice(start, start + item.num_tokens))
        rows[i] = row_of(request)
        if request.params.lora_id:
            if lora_ids is None:
                lora_ids = np.zeros(num_seqs, dtype=np.int32)
            lora_ids[i] = request.params.lora_id
        if item.num_tokens == 1 and num_decodes == i:
            num_decodes += 1
    tables = block_rows.table[rows, :max_blocks]
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - query_start[seq_of_token] + starts[seq_of_token]
    slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    logits_indices = query_start[1:][sample_rows] - 1
    score_targets, score_k = None, 0
    if batch.prompt_scores:  # the scored positions' rows after the sampled ones, and their next tokens
        rows_, targets = [logits_indices], []
        for i, first, count in batch.prompt_scores:
            request = scheduled[i].request
            rows_.append(query_start[i] + first - starts[i] + np.arange(count))
            targets.extend(request.prompt_ids[first + 1:first + 1 + count])
            score_k = max(score_k, request.params.prompt_log_probs)
        logits_indices = np.concatenate(rows_)
        score_targets = np.asarray(targets, dtype=np.int64)
    return StepInput(np.asarray(ids, dtype=np.int64), positions, slots, tables, query_start.astype(np.int32),
                     seq_lens.astype(np.int32), logits_indices, num_decodes, score_targets, score_k, lora_ids)
