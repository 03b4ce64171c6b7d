"""The block manager kit: :class:`BlockManagerConformance`."""

from __future__ import annotations

import random
from typing import Any, ClassVar

from nanovllm_core.engine.options import instantiate
from nanovllm_core.interfaces import BlockManager, Scheduler
from nanovllm_core.plugins import check_registration
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.sequence import Sequence
from nanovllm_testing.conformance._shared import assert_done, installed_plugin
from nanovllm_testing.simulated import SimulatedEngine, random_tokens


class BlockManagerConformance:
    """Checks a :class:`~nanovllm_core.BlockManager`; set ``block_manager_cls`` in a ``Test...`` subclass.

    Set ``supports_prefix_caching = False`` for a manager that never finds cached blocks. The scheduler for
    the end-to-end check is the installed ``scheduler_name`` (``fifo``) unless ``scheduler_cls`` is set.
    """

    block_manager_cls: ClassVar[type[BlockManager]]
    block_manager_options: ClassVar[dict[str, Any]] = {}
    supports_prefix_caching: ClassVar[bool] = True
    scheduler_cls: ClassVar[type[Scheduler] | None] = None
    scheduler_name: ClassVar[str] = "fifo"
    block_size: ClassVar[int] = 16

    def make(self, num_blocks: int, enable_prefix_caching: bool = True) -> BlockManager:
        return instantiate(
            "block_manager", self.block_manager_cls, dict(self.block_manager_options), num_blocks, self.block_size,
            enable_prefix_caching=enable_prefix_caching,
        )

    @staticmethod
    def seq(tokens: list[int]) -> Sequence:
        return Sequence(tokens, SamplingParams(max_tokens=64))

    @staticmethod
    def compute(bm: BlockManager, seq: Sequence) -> None:
        """What a step does once the KV of every token of ``seq`` is written: advance and cache."""
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)

    def test_is_a_block_manager(self) -> None:
        problem = check_registration("block_manager", self.block_manager_cls)
        assert problem is None, problem

    def test_starts_with_every_block_free(self) -> None:
        bm = self.make(8)
        got = (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_used_blocks)
        assert got == (8, self.block_size, 8, 0), f"(num_blocks, block_size, free, used) of a new manager: {got}"

    def test_allocate_covers_the_tokens_and_free_returns_every_block(self) -> None:
        bm, bs = self.make(8), self.block_size
        seq = self.seq(list(range(2 * bs + 3)))
        assert bm.allocate(seq, seq.num_uncomputed_tokens), "allocate failed with every block free"
        table = list(seq.block_table)
        assert len(table) == 3 and len(set(table)) == 3 and all(0 <= b < 8 for b in table), (
            f"{2 * bs + 3} tokens need 3 distinct blocks in [0, 8); got {table}"
        )
        assert bm.num_free_blocks == 5, f"3 of 8 blocks in use but num_free_blocks is {bm.num_free_blocks}"
        bm.free(seq)
        assert seq.block_table == [], "free must clear the block table"
        assert bm.num_free_blocks == 8, f"after free, {bm.num_free_blocks} of 8 blocks are free"
        bm.free(seq)
        assert bm.num_free_blocks == 8, "free must be idempotent"

    def test_allocate_is_all_or_nothing(self) -> None:
        bm, bs = self.make(4), self.block_size
        a = self.seq(list(range(3 * bs)))
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(list(range(1000, 1000 + 2 * bs)))
        assert not bm.allocate(b, b.num_uncomputed_tokens), "allocated 2 blocks with 1 free"
        state = (b.block_table, b.num_computed_tokens, bm.num_free_blocks)
        assert state == ([], 0, 1), "a failed allocate changed state"
        before = list(a.block_table)
        assert not bm.allocate(a, bs + 1), "grew a sequence by 2 blocks with 1 free"
        assert a.block_table == before and bm.num_free_blocks == 1, "a failed allocate changed state"
        bm.free(a)
        assert bm.num_free_blocks == 4, f"after free, {bm.num_free_blocks} of 4 blocks are free"

    def test_decode_appends_a_block_only_at_a_boundary(self) -> None:
        bm, bs = self.make(4), self.block_size
        seq = self.seq(list(range(bs)))
        assert bm.allocate(seq, seq.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, seq)
        assert len(seq.block_table) == 1, f"{bs} tokens need one block, got {seq.block_table}"
        seq.append_token(7)
        assert bm.allocate(seq, 1) and len(seq.block_table) == 2, "token bs+1 needs a second block"
        self.compute(bm, seq)
        seq.append_token(8)
        assert bm.allocate(seq, 1) and len(seq.block_table) == 2, "token bs+2 fits the second block"
        bm.free(seq)
        assert bm.num_free_blocks == 4, f"after free, {bm.num_free_blocks} of 4 blocks are free"

    def test_prefix_cache_hit_is_the_shared_full_block_prefix(self) -> None:
        import pytest
        if not self.supports_prefix_caching:
            pytest.skip("supports_prefix_caching = False")
        bm, bs = self.make(16), self.block_size
        shared = list(range(100, 100 + 2 * bs))
        a = self.seq(shared + [1, 2, 3, 4, 5])
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(shared + [9, 9, 9, 9, 9, 9, 9])
        free_before = bm.num_free_blocks
        assert bm.num_cached_tokens(b) == 2 * bs, "the 2 shared full blocks are not found"
        assert bm.num_free_blocks == free_before and b.block_table == [], "num_cached_tokens must have no side effects"
        assert bm.num_cached_tokens(self.seq(shared[:bs] + [7] * bs + [1])) == bs, "only the first block is shared"
        assert bm.num_cached_tokens(self.seq(list(shared))) == bs, (
            "a prompt of exactly 2 cached blocks may reuse only 1: the last token is always computed"
        )
        assert bm.num_cached_tokens(self.seq([5] + shared)) == 0, "a shifted prefix must not hit"
        assert bm.allocate(b, b.num_uncomputed_tokens), "allocate failed with enough free blocks"
        assert b.num_computed_tokens == 2 * bs, "allocate must advance num_computed_tokens past the cached prefix"
        assert b.block_table[:2] == a.block_table[:2], "the cached prefix must be a's blocks"
        assert bm.num_used_blocks == len(set(a.block_table) | set(b.block_table)), "shared blocks counted twice"
        bm.free(a)
        assert bm.num_used_blocks == len(b.block_table), "blocks b shares with a must stay in use after free(a)"
        bm.free(b)
        assert bm.num_free_blocks == 16, f"after freeing both, {bm.num_free_blocks} of 16 blocks are free"

    def test_prefix_caching_disabled_finds_nothing(self) -> None:
        bm, bs = self.make(16, enable_prefix_caching=False), self.block_size
        shared = list(range(100, 100 + 2 * bs))
        a = self.seq(shared + [1])
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(shared + [2])
        assert bm.num_cached_tokens(b) == 0, "found cached tokens with enable_prefix_caching=False"
        assert bm.allocate(b, b.num_uncomputed_tokens), "allocate failed with enough free blocks"
        assert b.num_computed_tokens == 0, "claimed cached tokens with enable_prefix_caching=False"
        assert not set(a.block_table) & set(b.block_table), "blocks shared with prefix caching disabled"
        bm.free(a)
        bm.free(b)
        assert bm.num_free_blocks == 16, f"after freeing both, {bm.num_free_blocks} of 16 blocks are free"

    def test_under_a_scheduler_with_shared_prefixes_and_kv_pressure(self) -> None:
        """The installed scheduler drives the manager; cached blocks must hold exactly their tokens."""
        scheduler_cls = self.scheduler_cls or installed_plugin("scheduler", self.scheduler_name, "scheduler_cls").obj
        sim = SimulatedEngine(
            scheduler_cls, self.block_manager_cls, num_blocks=10, block_size=self.block_size,
            block_manager_options=self.block_manager_options, max_num_seqs=4, max_num_batched_tokens=48,
        )
        rng = random.Random(7)
        families = [random_tokens(self.block_size * k, rng) for k in (1, 2, 3)]
        for wave in range(3):
            for i in range(4):
                sim.add(families[(wave + i) % 3] + random_tokens(rng.randint(1, 20), rng), rng.randint(4, 24))
            for _ in range(6):
                if sim.core.has_unfinished_requests():
                    sim.step()
        sim.run()
        assert_done(sim, 12)
