"""A step's host arrays copied to the device from pinned memory, without waiting.

A copy to the GPU from ordinary (pageable) memory makes the host wait until it is done, and a
step sends several (ids, positions, slots, block tables, lengths): with async scheduling the host
would stall on each. Here each array goes through one of two persistent pinned buffers, taken in
turn by step, and the copy is queued. A buffer is written again two steps later, and only after
the event recorded behind that step's copies has passed, so the device never reads a half-new
array. On a CPU there is nothing to copy: the arrays are used where they are.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

_ALIGN = 64


class HostStaging:
    def __init__(self, device: torch.device, capacity_bytes: int, pinned: bool | None = None, num_buffers: int = 2):
        """`capacity_bytes`: what one step's arrays take at most (a larger step falls back to an
        ordinary copy, logged once). `pinned`: default, where the device is a GPU."""
        self.device = device
        self.staged = device.type == "cuda" if pinned is None else pinned
        self._buffers = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
                         for _ in range(num_buffers)] if self.staged else []
        self._events: list = [None] * num_buffers
        self._turn, self._offset, self._warned = 0, 0, False

    def begin_step(self) -> None:
        """Takes the next buffer, once the device has read what it was given two steps ago."""
        if not self.staged:
            return
        self._turn = (self._turn + 1) % len(self._buffers)
        self._offset = 0
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()

    def host(self, array: np.ndarray) -> torch.Tensor:
        """`array` as a host tensor to copy from without waiting: in this step's pinned buffer."""
        a = np.ascontiguousarray(array)
        if not self.staged:
            return torch.from_numpy(a)
        buffer = self._buffers[self._turn]
        end = self._offset + a.nbytes
        if end > buffer.numel():
            if not self._warned:
                logger.warning("a step's inputs outgrew the pinned staging buffers (%d bytes): copied from "
                               "ordinary memory", buffer.numel())
                self._warned = True
            return torch.from_numpy(a)
        host = buffer[self._offset:end]
        host.numpy()[:] = a.reshape(-1).view(np.uint8)
        self._offset = -(-end // _ALIGN) * _ALIGN
        return host.view(torch.from_numpy(a[:0]).dtype).view(a.shape)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return self.host(array).to(self.device, non_blocking=True)

    def end_step(self) -> None:
        """Marks the point the device must pass before this step's buffer is written again."""
        if self.staged and self.device.type == "cuda":
            self._events[self._turn] = torch.cuda.Event()
            self._events[self._turn].record()
