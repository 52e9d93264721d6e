"""Data parallelism: N independent engines (one per GPU or CPU core set, each with its own
scheduler, KV cache and worker processes) behind the one `llm` model, as one AsyncEngine.

A request goes to the engine that already holds its prompt's longest cached prefix, where one
does, the prefix is at least half the prompt's blocks, that engine has room for it, and it does
not hold many more requests than the least loaded engine (so that a system prompt that every
request shares does not send them all to one engine); otherwise to the engine with the most free
KV blocks, less the blocks of the requests sent to it that it has not started yet (so that a
burst spreads instead of landing on the engine that looked emptiest before it).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from tritone.engine.async_engine import AsyncEngine
from tritone.engine.core import LLMEngine
from tritone.scheduling.request import FinishReason, RequestOutput, SamplingParams

# Prompt blocks remembered for routing (an LRU of block hashes): enough for the prefixes that
# matter (system prompts, conversations), bounded whatever the traffic.
MAX_REMEMBERED_BLOCKS = 1 << 16
# Prompt blocks hashed per request at most: a prefix longer than this routes by its start.
MAX_HASHED_BLOCKS = 64
# Requests an engine may hold beyond the least loaded one's and still get a prefix it caches.
BALANCE_SLACK = 8


def prompt_block_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's leading full blocks: equal exactly where the prefixes are."""
    n = min(len(prompt_ids) // block_size, MAX_HASHED_BLOCKS)
    tokens = np.asarray(prompt_ids[:n * block_size], dtype=np.int64)
    hashes, h = [], b""
    for i in range(n):
        h = hashlib.blake2b(h + tokens[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        hashes.append(h)
    return hashes


class DataParallelEngine:
    """The AsyncEngine interface (submit, abort, stop, num_steps, is_alive) over N engines."""

    def __init__(self, builds: list[Callable[[], LLMEngine]], on_output: Callable[[RequestOutput], None],
                 on_fatal: Callable[[str], None] = lambda message: None):
        self.on_output = on_output
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # request id -> its engine
        self._unstarted: dict[str, int] = {}  # request id -> its prompt's blocks, until its first output
        self._pending_blocks = [0] * len(builds)
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()
        # The engines start together: each loads its model in its own worker processes.
        with ThreadPoolExecutor(len(builds)) as pool:
            futures = [pool.submit(AsyncEngine, build, self._sender(i), on_fatal) for i, build in enumerate(builds)]
            failures = [f.exception() for f in futures]
            self.engines = [f.result() for f in futures if f.exception() is None]
        if any(failures):
            for engine in self.engines:
                engine.stop(timeout=0)
            raise next(exc for exc in failures if exc is not None)
        self.block_size = self.engines[0].engine.config.block_size

    def _sender(self, index: int) -> Callable[[RequestOutput], None]:
        def send(output: RequestOutput) -> None:
            with self._lock:
                blocks = self._unstarted.pop(output.request_id, None)
                if blocks is not None:
                    self._pending_blocks[index] -= blocks
                if output.finished:
                    self._owner.pop(output.request_id, None)
            self.on_output(output)

        return send

    @property
    def num_steps(self) -> int:
        return sum(e.num_steps for e in self.engines)

    @property
    def is_alive(self) -> bool:
        return all(e.is_alive for e in self.engines)

    def route(self, prompt_ids: list[int]) -> int:
        """The engine for a prompt (see the module's docstring); remembers the prompt's blocks there."""
        hashes = prompt_block_hashes(prompt_ids, self.block_size)
        need = -(-len(prompt_ids) // self.block_size)
        with self._lock:
            room = [e.engine.block_manager.num_free_blocks - pending
                    for e, pending in zip(self.engines, self._pending_blocks)]
            load = [0] * len(self.engines)
            for index in self._owner.values():
                load[index] += 1
            chosen = None
            for matched in range(len(hashes), 0, -1):  # the longest remembered prefix
                index = self._prefixes.get(hashes[matched - 1])
                if index is not None:
                    if (2 * matched >= len(hashes) and room[index] >= need and self.engines[index].is_alive
                            and load[index] <= min(load) + max(BALANCE_SLACK, min(load) // 4)):
                        chosen = index
                    break
            if chosen is None:
                chosen = max(range(len(self.engines)), key=lambda i: (self.engines[i].is_alive, room[i]))
            for h in hashes:
                self._prefixes[h] = chosen
                self._prefixes.move_to_end(h)
            while len(self._prefixes) > MAX_REMEMBERED_BLOCKS:
                self._prefixes.popitem(last=False)
        return chosen

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        index = self.route(prompt_ids)
        need = -(-len(prompt_ids) // self.block_size)
        with self._lock:
            self._owner[request_id] = index
            self._unstarted[request_id] = need
            self._pending_blocks[index] += need
        try:
            self.engines[index].submit(request_id, prompt_ids, params)
        except BaseException:
            with self._lock:
                self._owner.pop(request_id, None)
                if self._unstarted.pop(request_id, None) is not None:
                    self._pending_blocks[index] -= need
            raise

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        index = self._owner.get(request_id)
        if index is not None:  # unknown: finished already (aborts may race with the end)
            self.engines[index].abort(request_id, reason, error)

    def stop(self, timeout: float = 30.0) -> None:
        with ThreadPoolExecutor(len(self.engines)) as pool:
            list(pool.map(lambda e: e.stop(timeout), self.engines))
