from __future__ import annotations

from nanovllm_scheduler_fifo import PrefixCachingBlockManager
from nanovllm_scheduler_fifo.block_manager import chain_hash

from nanovllm_core import SamplingParams, Sequence


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=4))


def admit(bm, s):
    assert bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens  # as if the step ran
    bm.cache_full_blocks(s)


def test_allocate_free_returns_every_block():
    bm = PrefixCachingBlockManager(8, 4)
    seqs = [seq(range(i, i + 7)) for i in range(3)]
    for s in seqs:
        admit(bm, s)
    assert bm.num_free_blocks == 8 - 6
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocation_is_all_or_nothing():
    bm = PrefixCachingBlockManager(3, 4)
    a = seq(range(9))  # 3 blocks
    admit(bm, a)
    b = seq(range(100, 105))
    assert not bm.allocate(b, b.num_uncomputed_tokens)
    assert b.block_table == [] and b.num_computed_tokens == 0 and bm.num_free_blocks == 0


def test_shared_prefix_is_ref_counted():
    bm = PrefixCachingBlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51])
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b, b.num_uncomputed_tokens)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache():
    bm = PrefixCachingBlockManager(16, 4)
    admit(bm, seq(range(8)))
    again = seq(range(8))  # exactly two full blocks, both cached
    assert bm.num_cached_tokens(again) == 4


def test_freed_blocks_stay_findable_until_reused():
    bm = PrefixCachingBlockManager(4, 4)
    a = seq(range(9))
    admit(bm, a)
    bm.free(a)
    b = seq(list(range(8)) + [99])
    assert bm.num_cached_tokens(b) == 8  # freed but hashed blocks still hit
    assert bm.allocate(b, b.num_uncomputed_tokens)
    bm.free(b)
    # fill the whole cache with other tokens: every old hash is evicted
    c = seq(range(200, 216))
    admit(bm, c)
    bm.free(c)
    assert bm.num_cached_tokens(seq(list(range(8)) + [99])) == 0


def test_hash_is_chained_and_collisions_are_checked():
    assert chain_hash(-1, [1, 2]) != chain_hash(chain_hash(-1, [0, 0]), [1, 2])
    bm = PrefixCachingBlockManager(8, 2)
    admit(bm, seq([1, 2, 3]))
    # forge a hash-table entry pointing at a block with other contents: lookup must not trust it
    other = seq([7, 7, 7])
    bm.hash_to_block_ids[bm._hashes(other, 1)[0]] = [0]
    assert bm.num_cached_tokens(other) == 0


def test_decode_appends_a_block_at_the_boundary():
    bm = PrefixCachingBlockManager(4, 4)
    s = seq(range(4))
    assert bm.allocate(s, 4)
    s.num_computed_tokens = 4
    s.append_token(9)
    assert len(s.block_table) == 1
    assert bm.allocate(s, 1)
    assert len(s.block_table) == 2


def test_prefix_caching_disabled():
    bm = PrefixCachingBlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, seq(range(9)))
    assert bm.num_cached_tokens(seq(range(9))) == 0


def check_index(bm):
    """Every hashed block is listed under its hash exactly once, and nothing else is."""
    listed = [(h, b) for h, ids in bm.hash_to_block_ids.items() for b in ids]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted((blk.hash, blk.block_id) for blk in bm.blocks if blk.hash != -1)


def test_every_copy_of_a_prefix_computed_in_one_step_stays_findable():
    """vLLM's scenario: two requests with one prefix admitted in the same step each compute their own copy;
    when the first copy is handed out to other tokens, the second (free, still holding the prefix) is found."""
    bm = PrefixCachingBlockManager(6, 16)
    prefix = list(range(100, 132))  # two full blocks
    a, b = seq(prefix + [1]), seq(prefix + [2])
    for s in (a, b):  # the same step: neither sees the other's blocks, which are not computed yet
        assert bm.allocate(s, s.num_uncomputed_tokens)
    assert set(a.block_table).isdisjoint(b.block_table)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    check_index(bm)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    other = seq(range(500, 533))  # three blocks: takes the least recently freed, which are a's
    admit(bm, other)
    assert set(other.block_table) == set(a_blocks)
    check_index(bm)
    again = seq(prefix + [3])
    assert bm.num_cached_tokens(again) == 32
    assert bm.allocate(again, again.num_uncomputed_tokens)
    assert again.block_table[:2] == b_blocks[:2] and again.num_computed_tokens == 32


def test_a_lookup_prefers_the_copy_in_use():
    bm = PrefixCachingBlockManager(8, 4)
    prefix = [1, 2, 3, 4]
    a, b = seq(prefix + [5]), seq(prefix + [6])
    for s in (a, b):
        assert bm.allocate(s, s.num_uncomputed_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    bm.free(a)  # a's copy is free, b's is in use
    c = seq(prefix + [7])
    free_before = bm.num_free_blocks
    assert bm.allocate(c, c.num_uncomputed_tokens)
    assert c.block_table[0] == b.block_table[0]
    assert bm.num_free_blocks == free_before - 1  # only c's own last block: sharing b's copy is free
    for s in (b, c):
        bm.free(s)
    check_index(bm)
    assert bm.num_free_blocks == 8


def test_allocate_many_takes_the_blocks_one_call_each_would_or_none():
    def decoding(bm):  # three sequences one token past a full block, one inside its block
        seqs = [seq(range(i * 10, i * 10 + 4)) for i in range(3)] + [seq(range(50, 53))]
        for s in seqs:
            admit(bm, s)
            s.append_token(7)
        return seqs

    one_by_one, at_once = PrefixCachingBlockManager(8, 4), PrefixCachingBlockManager(8, 4)
    expected = decoding(one_by_one)
    for s in expected:
        assert one_by_one.allocate(s, 1)
    got = decoding(at_once)
    assert at_once.allocate_many(got, [1] * 4)
    assert [s.block_table for s in got] == [s.block_table for s in expected]
    assert list(at_once.free_block_ids) == list(one_by_one.free_block_ids)

    short = PrefixCachingBlockManager(6, 4)  # 4 blocks held, 2 free for 3 sequences that need one each
    seqs = decoding(short)
    tables = [list(s.block_table) for s in seqs]
    assert not short.allocate_many(seqs, [1] * 4)
    assert [s.block_table for s in seqs] == tables and short.num_free_blocks == 2
