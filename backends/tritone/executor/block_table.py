"""The block tables of running requests, kept from step to step.

Each running request owns one row of a preallocated table while it runs; a step writes only the
blocks a request gained since the last one (usually none, or one), and the step's table is one
gather of its requests' rows. Rebuilt from the requests' block lists every step, the table cost
a Python slice and copy per request per step, growing with the context. A request that is new,
or lost its blocks to preemption since its row was written, gets its whole row rewritten.
"""

from __future__ import annotations

import numpy as np

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
