"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

A full block is identified by a hash chained over every token before it, so equal hashes mean
equal prefixes. A block whose reference count drops to zero keeps its hash and stays findable
until it is reused; free blocks are reused least recently freed first (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tritone.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front was freed longest ago.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

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
        self._extend_hashes(request, request.num_tokens - 1)
        hits = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
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
        self._register_full_blocks(request, num_computed + num_new_tokens)
        return True

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
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))))

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Tokens scheduled in this step are known now and computed before the next schedule,
        # so their full blocks can be published at once.
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(request, num_tokens)
        for i in range(min(len(request.block_hashes), len(request.block_ids))):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                block_hash = request.block_hashes[i]
                if block_hash not in self.cached_blocks:
                    self.cached_blocks[block_hash] = block.block_id
                    block.block_hash = block_hash
