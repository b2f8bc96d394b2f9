"""Block manager: allocation, ref counts, prefix cache by chained block hash, LRU eviction."""
from __future__ import annotations

import pytest

from resident.worker.block_manager import BlockManager
from resident.worker.request import Request
from resident.worker.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), arrival_index=0, max_output_tokens=8)


def admit(bm: BlockManager, req: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler does: prefix lookup, allocate, mark computed. Returns the hit."""
    blocks, num_cached = bm.get_computed_blocks(req)
    num_new = req.num_tokens - num_cached if num_new is None else num_new
    assert bm.allocate_slots(req, num_new, blocks)
    req.start_running(num_cached)
    return num_cached


def compute(bm: BlockManager, req: Request, num_tokens: int) -> None:
    req.advance(num_tokens)
    bm.cache_full_blocks(req)
    bm.check_integrity()


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))  # 3 blocks
    admit(bm, a)
    assert len(bm.block_table("a")) == 3
    assert bm.check_integrity().num_used == 3
    assert bm.usage == pytest.approx(3 / 8)
    # Growing by decode steps: a new block only when the last one is full.
    compute(bm, a, 10)
    for position, token in ((10, 50), (11, 51)):  # positions 8..11 share block 2
        a.append_output_token(token)
        assert bm.allocate_slots(a, 1)
        assert len(bm.block_table("a")) == 3, position
        compute(bm, a, 1)
    a.append_output_token(52)
    assert bm.allocate_slots(a, 1)  # position 12 needs block 3
    assert len(bm.block_table("a")) == 4
    bm.free(a)
    counts = bm.check_integrity()
    assert counts.num_used == 0 and bm.usage == 0.0
    assert counts.num_free + counts.num_evictable == 8
    assert counts.num_evictable == 3  # the three full, computed blocks stay cached


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(bm, a)
    b = make_request("b", list(range(100, 108)))
    before = bm.check_integrity()
    assert not bm.allocate_slots(b, 8, [])
    assert bm.check_integrity() == before
    assert bm.block_table("b") == []


def test_prefix_hit_covers_full_blocks_only_and_never_the_whole_sequence():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(14)))  # blocks [0-3][4-7][8-11][12,13]
    admit(bm, a)
    compute(bm, a, 14)
    assert bm.check_integrity().num_used == 4

    same_prefix = make_request("b", list(range(12)) + [99, 98, 97])
    blocks, n = bm.get_computed_blocks(same_prefix)
    assert n == 12 and blocks == bm.block_table("a")[:3]

    exactly_cached = make_request("c", list(range(12)))  # all 3 blocks cached: one token must be left
    blocks, n = bm.get_computed_blocks(exactly_cached)
    assert n == 8 and blocks == bm.block_table("a")[:2]

    diverges_in_block_1 = make_request("d", [0, 1, 2, 3, 4, 5, 6, 77, 8, 9, 10, 11, 12])
    assert bm.get_computed_blocks(diverges_in_block_1)[1] == 4

    # Block 2's tokens after a different prefix: the chained hash must not match.
    other_prefix = make_request("e", [9, 9, 9, 9, 4, 5, 6, 7, 8, 9, 10, 11, 1])
    assert bm.get_computed_blocks(other_prefix)[1] == 0
    # Cached blocks in another order are other prefixes: no hit at all.
    swapped = make_request("f", [4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 1])
    assert bm.get_computed_blocks(swapped)[1] == 0


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(bm, a)
    compute(bm, a, 10)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == 8
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert bm.check_integrity().num_used == 3 + 1  # a: 3, b: 1 private + 2 shared
    bm.free(a)
    counts = bm.check_integrity()
    assert counts.num_used == 3  # shared blocks still held by b
    bm.free(b)
    assert bm.check_integrity().num_used == 0


def test_evictable_blocks_are_reused_after_plain_free_ones_in_lru_order():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1
    admit(bm, a)
    compute(bm, a, 9)
    bm.free(a)
    b = make_request("b", list(range(100, 109)))
    admit(bm, b)
    compute(bm, b, 9)
    bm.free(b)
    counts = bm.check_integrity()
    assert (counts.num_free, counts.num_evictable) == (2, 4)
    # Taking 2 blocks uses the plain free ones: both prefixes stay cached.
    c = make_request("c", list(range(200, 208)))
    admit(bm, c)
    assert bm.get_computed_blocks(make_request("a2", list(range(9))))[1] == 8
    assert bm.get_computed_blocks(make_request("b2", list(range(100, 109))))[1] == 8
    # Two more evict a's blocks (released first), tail block first.
    d = make_request("d", list(range(300, 305)))
    admit(bm, d)
    assert bm.get_computed_blocks(make_request("a3", list(range(9))))[1] == 0
    assert bm.get_computed_blocks(make_request("b3", list(range(100, 109))))[1] == 8
    bm.check_integrity()


def test_reviving_evictable_hit_counts_against_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute(bm, a, 9)
    bm.free(a)  # 2 evictable + 2 free
    # Needs its 2 cached blocks revived plus 3 new: only 2 are left once the hit is revived.
    big = make_request("big", list(range(8)) + list(range(50, 59)))
    blocks, n = bm.get_computed_blocks(big)
    assert n == 8
    assert not bm.allocate_slots(big, big.num_tokens - n, blocks)
    bm.check_integrity()
    small = make_request("small", list(range(8)) + [50, 51])
    blocks, n = bm.get_computed_blocks(small)
    assert bm.allocate_slots(small, small.num_tokens - n, blocks)
    assert bm.check_integrity().num_used == 3


def test_blocks_with_output_tokens_are_cached_for_resume():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(6)))
    admit(bm, a)
    compute(bm, a, 6)
    for t in (40, 41, 42):
        a.append_output_token(t)
        assert bm.allocate_slots(a, 1)
        compute(bm, a, 1)
    bm.free(a)  # preempted: 9 computed tokens -> 2 full blocks cached
    resumed_tokens = make_request("a-again", list(range(6)) + [40, 41, 42])
    assert bm.get_computed_blocks(resumed_tokens)[1] == 8


def test_duplicate_content_stays_unregistered():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    admit(bm, a)
    admit(bm, b)  # admitted in the same step: no hit yet
    compute(bm, a, 6)
    compute(bm, b, 6)
    bm.free(a)
    bm.free(b)
    counts = bm.check_integrity()
    assert counts.num_evictable == 1 and counts.num_free == 7


def test_prefix_caching_disabled_and_reset():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute(bm, a, 9)
    bm.free(a)
    assert bm.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert bm.check_integrity().num_evictable == 0

    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute(bm, a, 9)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.check_integrity().num_evictable == 0
    assert bm.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    admit(bm, a)
    bm._ref_counts[bm.block_table("a")[0]] += 1  # a leaked reference
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity()


def test_decode_growth_extends_the_table_and_caches_each_block_as_it_fills():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", [1, 2, 3])
    admit(bm, req)
    first = list(bm.block_table("a"))   # the live table grows in place
    assert len(first) == 1
    for t in range(10):   # one decode token per step, as the scheduler runs them
        req.advance(req.num_tokens - req.num_computed_tokens)
        bm.cache_full_blocks(req)
        req.append_output_token(100 + t)
        assert bm.allocate_slots(req, 1)
        assert len(bm.block_table("a")) == -(-req.num_tokens // 4)
        bm.check_integrity()
    assert bm.block_table("a")[:1] == first
    # Every block filled on the way is in the prefix cache: a copy of the sequence hits them.
    twin = make_request("b", list(req.all_token_ids))
    blocks, num_cached = bm.get_computed_blocks(twin)
    assert num_cached == 12 and blocks == bm.block_table("a")[:3]
    assert not bm.allocate_slots(req, 4 * 8), "more tokens than free blocks"
    assert len(bm.block_table("a")) == 4
