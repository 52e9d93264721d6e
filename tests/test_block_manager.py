from tritone.block_manager import BlockManager
from tritone.request import Request, SamplingParams


def make_request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


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
    assert bm.allocate(a, 9)
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
    assert bm.allocate(a, 8)
    b = make_request(range(8), "b")
    assert len(bm.find_cached_blocks(b)) == 1  # the last token must be computed for logits


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(range(5), "a")
    assert bm.allocate(a, 5)
    head = a.block_ids[0]
    bm.free(a)
    again = make_request(list(range(4)) + [7], "x")
    assert bm.find_cached_blocks(again) == [head]  # still findable after free
    c = make_request(range(100, 116), "c")
    assert bm.allocate(c, 16)  # needs all four blocks: the cached one is evicted
    assert bm.cached_blocks and all(bm.blocks[b].ref_count == 1 for b in c.block_ids)
    d = make_request(list(range(4)) + [5], "d")
    assert bm.find_cached_blocks(d) == []


def test_eviction_prefers_the_tail_of_a_freed_request():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request(range(6), "a")
    assert bm.allocate(a, 6)
    first, _, last = a.block_ids
    bm.free(a)
    b = make_request(range(50, 52), "b")
    assert bm.allocate(b, 2)
    assert b.block_ids == [last]  # the shared-prefix head survives longest
    assert bm.blocks[first].block_hash is not None


def test_prefix_caching_off_finds_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request(range(9), "a")
    assert bm.allocate(a, 9)
    assert bm.find_cached_blocks(make_request(range(9), "b")) == []
