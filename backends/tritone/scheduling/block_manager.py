"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

A full block is identified by a hash chained over every token before it. A block is published
(findable by its hash) only once its KV has been written, that is after the forward pass that
computed it succeeded. A block whose reference count drops to zero keeps its hash and stays
findable until it is reused; free blocks are reused least recently freed first (LRU eviction).

The prefix cache is shared by every request, so one request must not be able to plant KV for
another's prompt (vLLM's CVE-2025-25183): the hash is SHA-256 over the parent's hash and the
block's token ids, chained from a random salt drawn per process, and a hit also compares the
block's stored token ids, so a hash collision can cost a miss but never a wrong answer.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from tritone.scheduling.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The block's tokens while it is published, checked on every hit.
    token_ids: tuple[int, ...] | None = None


def chain_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and found there, each prompt counted once (at
    its first admission, not at every attempt or after a preemption), over the last `window`
    prompts. Written by the engine thread, read by the metrics reporter."""

    def __init__(self, window: int = 1000):
        self.recent: deque[tuple[int, int]] = deque()
        self.window = window
        self.num_queried = self.num_hit = 0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.recent.append((num_queried, num_hit))
        self.num_queried += num_queried
        self.num_hit += num_hit
        if len(self.recent) > self.window:
            old_queried, old_hit = self.recent.popleft()
            self.num_queried -= old_queried
            self.num_hit -= old_hit

    @property
    def hit_rate(self) -> float:
        num_queried, num_hit = self.num_queried, self.num_hit
        return num_hit / num_queried if num_queried else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front was freed longest ago.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.root_hash = os.urandom(32)
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of the request's tokens (at most all but one token,
        since the last token must be computed to get logits)."""
        if not self.enable_prefix_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, num_full)
        hits = []
        for i in range(num_full):
            block_id = self.cached_blocks.get(request.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(request, i):
                break
            hits.append(block_id)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Gives the request blocks for `num_new_tokens` more tokens, after taking the cached
        prefix blocks. Returns False, changing nothing, when too few blocks are free."""
        num_computed = request.num_computed_tokens + len(cached_block_ids) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_needed -= len(request.block_ids) + len(cached_block_ids)
        num_reclaimable = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_needed > self.num_free_blocks - num_reclaimable:
            return False
        for block_id in cached_block_ids:
            self._take(block_id)
            request.block_ids.append(block_id)
        for _ in range(max(num_needed, 0)):
            request.block_ids.append(self._take_free())
        if cached_block_ids:
            request.num_published_blocks = len(cached_block_ids)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publishes the request's blocks that its computed tokens fill. Call it only after the
        forward pass that wrote their KV, so a failed step leaves no hash of unwritten KV behind.
        Looks only at blocks filled since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_published_blocks:
            return
        self._extend_hashes(request, num_full)
        for i in range(request.num_published_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            block_hash = request.block_hashes[i]
            # A block taken from the cache is published already; an equal block computed twice
            # (two requests with one prefix in one step) is published once.
            if block.block_hash is None and block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block.block_id
                block.block_hash, block.token_ids = block_hash, self._block_tokens(request, i)
        request.num_published_blocks = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks; the tail goes to the eviction front, since a shared
        prefix is likelier to be asked for again than a request's own last block."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        request.block_ids = []
        request.num_published_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.tokens_slice(index * self.block_size, (index + 1) * self.block_size))

    def _root(self, lora_id: int) -> bytes:
        return self.root_hash if not lora_id else chain_hash(self.root_hash, [-lora_id])

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            # An adapter's KV differs from the base model's for the same tokens: its chain has
            # a root of its own.
            parent = hashes[-1] if hashes else self._root(request.params.lora_id)
            hashes.append(chain_hash(parent, self._block_tokens(request, i)))
