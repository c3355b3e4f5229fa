from slotune.engine.block_manager import BlockManager
from slotune.engine.sampling_params import SamplingParams
from slotune.engine.sequence import Sequence


def _seq(tokens, rid="r"):
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), 0.0)


def test_allocate_grows_table_and_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    assert bm.allocate(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    assert bm.allocate(s, 3)  # 13 needs a 4th
    assert len(s.block_table) == 4
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_allocate_refuses_without_partial_change():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = _seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_hits_shared_full_blocks_and_refcounts():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = _seq(list(range(10)), "a")
    bm.match_prefix(a)
    assert a.num_computed_tokens == 0
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = _seq(list(range(8)) + [99, 98, 97], "b")
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    # A different first block breaks the chain even if later blocks match.
    c = _seq([7, 7, 7, 7] + list(range(4, 10)), "c")
    bm.match_prefix(c)
    assert c.num_computed_tokens == 0


def test_prefix_cache_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = _seq(list(range(8)), "a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = _seq(list(range(8)), "b")
    bm.match_prefix(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed to produce logits


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    first = a.block_table[0]
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    b = _seq([1, 2, 3, 4, 9], "b")
    bm.match_prefix(b)
    assert b.block_table[0] == first and b.num_computed_tokens == 4
    bm.free_seq(b)
    # Filling the cache evicts the hashed blocks and removes them from the index.
    c = _seq(list(range(100, 108)), "c")
    assert bm.allocate(c, 8)
    assert bm.hash_to_block == {}
