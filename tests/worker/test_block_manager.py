"""The block manager's bookkeeping, on CPU, without a model."""

import pytest

from protos.block_hash import block_hashes
from worker.engine.block_manager import BlockManager
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the engine does for a whole prompt in one step."""
    cached = bm.find_cached_prefix(s)
    s.num_computed_tokens = len(cached[0]) * BS
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS, "m")
    a, b = seq(range(10), "a"), seq(range(100, 103), "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free_blocks == 4
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_integrity([])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(2, BS, "m")
    s = seq(range(12))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_stops_one_token_short():
    bm = BlockManager(16, BS, "m")
    a = seq(range(12), "a")  # exactly 3 full blocks
    run_prefill(bm, a)
    b = seq(range(12), "b")
    blocks, hashes = bm.find_cached_prefix(b)
    # The last block is not reused: the last prompt token must be computed to get logits.
    assert blocks == a.block_table[:2]
    assert hashes == block_hashes(list(range(12)), BS, "m")[:2]
    c = seq(list(range(8)) + [99, 98, 97, 96, 95], "c")
    assert bm.find_cached_prefix(c)[0] == a.block_table[:2]
    run_prefill(bm, c)
    assert c.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2
    bm.check_integrity([a, c])


def test_cached_blocks_survive_free_and_are_evicted_lru_tail_first():
    bm = BlockManager(4, BS, "m")
    a = seq(range(8), "a")
    run_prefill(bm, a)
    first, second = a.block_table
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.find_cached_prefix(seq(range(9)))[0] == [first, second]  # still findable
    bm.drain_events()
    # Take 3 blocks: 2 free ones, then one eviction, which must be the tail block of `a`.
    big = seq(range(50, 62), "big")
    assert bm.allocate(big, 12)
    events = bm.drain_events()
    assert [e.kind for e in events] == ["evicted"]
    assert events[0].block_hash == block_hashes(list(range(8)), BS, "m")[1]
    assert second in big.block_table and first not in big.block_table
    assert bm.find_cached_prefix(seq(range(9)))[0] == [first]
    bm.check_integrity([big])


def test_events_report_stored_blocks_once():
    bm = BlockManager(8, BS, "m")
    a, b = seq(range(8), "a"), seq(range(8), "b")
    for s in (a, b):  # b computes the same content concurrently (no hit: a not yet cached)
        s.num_computed_tokens = 0
        assert bm.allocate(s, 8)
    for s in (a, b):
        s.num_computed_tokens = 8
        bm.cache_full_blocks(s)
    stored = [e for e in bm.drain_events() if e.kind == "stored"]
    assert [e.block_hash for e in stored] == block_hashes(list(range(8)), BS, "m")
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])  # b's duplicate blocks went back to the free list, not the cache
    bm.reset_prefix_cache()
    assert [e.kind for e in bm.drain_events()][-1] == "cleared"
    assert bm.find_cached_prefix(seq(range(9)))[0] == []


def test_double_free_is_caught():
    bm = BlockManager(4, BS, "m")
    s = seq(range(4))
    run_prefill(bm, s)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.free(s)


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, BS, "m", enable_prefix_caching=False)
    a = seq(range(12), "a")
    run_prefill(bm, a)
    assert bm.find_cached_prefix(seq(range(12)))[0] == []
    assert bm.drain_events() == []
