from tritone.scheduling.block_manager import BlockManager
from tritone.scheduling.request import Request, SamplingParams


def make_request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def compute(bm, req, num_tokens):
    """Allocates for `num_tokens` more tokens and, as the engine does once the forward pass has
    written their KV, counts them computed and publishes the blocks they fill."""
    assert bm.allocate(req, num_tokens)
    req.num_computed_tokens += num_tokens
    bm.cache_computed_blocks(req)


def test_allocate_rounds_up_to_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(range(10))
    assert bm.allocate(req, 10)
    assert len(req.block_ids) == 3
    assert bm.num_free_blocks == 5
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_ids == []


def test_allocate_refuses_without_changing_anything():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(range(12))
    assert not bm.allocate(req, 12)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_decode_grows_one_block_at_the_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(range(4))
    assert bm.allocate(req, 4)
    req.num_computed_tokens = 4
    req.output_ids.append(99)
    assert bm.allocate(req, 1)
    assert len(req.block_ids) == 2


def test_prefix_blocks_are_shared_with_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)), "a")
    compute(bm, a, 9)
    b = make_request(list(range(8)) + [42, 43], "b")
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, 2, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    bm.free(a)
    assert bm.blocks[b.block_ids[0]].ref_count == 1
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(range(8), "a")
    compute(bm, a, 8)
    b = make_request(range(8), "b")
    assert len(bm.find_cached_blocks(b)) == 1  # the last token must be computed for logits


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(range(5), "a")
    compute(bm, a, 5)
    head = a.block_ids[0]
    bm.free(a)
    again = make_request(list(range(4)) + [7], "x")
    assert bm.find_cached_blocks(again) == [head]  # still findable after free
    c = make_request(range(100, 116), "c")
    compute(bm, c, 16)  # needs all four blocks: the cached one is evicted
    assert bm.cached_blocks and all(bm.blocks[b].ref_count == 1 for b in c.block_ids)
    d = make_request(list(range(4)) + [5], "d")
    assert bm.find_cached_blocks(d) == []


def test_eviction_prefers_the_tail_of_a_freed_request():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request(range(6), "a")
    compute(bm, a, 6)
    first, _, last = a.block_ids
    bm.free(a)
    b = make_request(range(50, 52), "b")
    assert bm.allocate(b, 2)
    assert b.block_ids == [last]  # the shared-prefix head survives longest
    assert bm.blocks[first].block_hash is not None


def test_prefix_caching_off_finds_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request(range(9), "a")
    compute(bm, a, 9)
    assert bm.find_cached_blocks(make_request(range(9), "b")) == []


def test_a_block_is_findable_only_once_its_kv_is_computed():
    # A step that fails after scheduling must leave nothing behind that a later prompt would
    # reuse as if its KV had been written.
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(range(9), "a")
    assert bm.allocate(a, 9)
    assert bm.find_cached_blocks(make_request(range(9), "b")) == [] and not bm.cached_blocks
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    assert bm.find_cached_blocks(make_request(range(9), "b")) == a.block_ids[:2]


def test_equal_hashes_with_different_tokens_never_share_a_block(monkeypatch):
    # Every block hashes alike: only the tokens stored with each cached block tell them apart.
    monkeypatch.setattr("tritone.scheduling.block_manager.chain_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(num_blocks=8, block_size=4)
    victim = make_request(range(9), "victim")
    compute(bm, victim, 9)
    attacker = make_request(range(100, 109), "attacker")
    assert bm.find_cached_blocks(attacker) == []
    compute(bm, attacker, 9)
    assert not set(attacker.block_ids) & set(victim.block_ids)
    assert bm.find_cached_blocks(make_request(range(9), "again")) == victim.block_ids[:1]


def test_block_hashes_are_sha256_chained_from_a_random_salt_per_process():
    import hashlib

    a, b = BlockManager(num_blocks=4, block_size=4), BlockManager(num_blocks=4, block_size=4)
    ra, rb = make_request(range(9), "a"), make_request(range(9), "b")
    compute(a, ra, 9)
    compute(b, rb, 9)
    assert a.root_hash != b.root_hash and ra.block_hashes != rb.block_hashes
    tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in range(4, 8))
    assert ra.block_hashes[1] == hashlib.sha256(ra.block_hashes[0] + tokens).digest()


class CountingList(list):
    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_per_step_block_work_does_not_grow_with_context():
    bm = BlockManager(num_blocks=300, block_size=4)
    req = make_request(range(1024))
    compute(bm, req, 1024)
    assert len(bm.cached_blocks) == 256
    bm.blocks = CountingList(bm.blocks)
    for step in range(8):
        req.output_ids.append(step)
        compute(bm, req, 1)
    assert bm.blocks.reads <= 2 * 8  # a new block and its publication, not every block
    assert len(bm.cached_blocks) == 258
