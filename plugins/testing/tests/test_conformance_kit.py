"""The conformance kit catches broken plugins: each check is run against a plugin with one deliberate bug.

Schedulers and block managers here (the simulated engine: no model or attention plugin needed); attention
backends and models in test_conformance_kit_attention.py and test_conformance_kit_model.py. The in-tree plugins
passing the same checks (``plugins/*/tests/test_conformance_*.py``) are the other half.
"""

from __future__ import annotations

import pytest
from kit_helpers import KitFailure, PreemptionKeepsComputedTokens
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager
from nanovllm_testing.conformance import BlockManagerConformance, SchedulerConformance

from nanovllm_core import Scheduler, SchedulerOutput

# --- schedulers with one bug each -------------------------------------------------------------------


class IgnoresTokenBudget(FifoScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_num_batched_tokens = 1 << 20


class IgnoresMaxNumSeqs(FifoScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_num_seqs = 1 << 20


class Lifo(FifoScheduler):
    """Admits the newest request first: under a stream of requests the oldest never runs."""

    def enqueue(self, seq) -> None:
        self.waiting.appendleft(seq)


class FinishKeepsBlocks(FifoScheduler):
    def finish(self, seq) -> None:
        free, self.block_manager.free = self.block_manager.free, lambda seq: None
        try:
            super().finish(seq)
        finally:
            self.block_manager.free = free


class NeverCachesBlocks(FifoScheduler):
    def __init__(self, config, block_manager) -> None:
        super().__init__(config, block_manager)
        block_manager.cache_full_blocks = lambda seq: None


class MisreadsAllocate(Scheduler):
    """Admits prompts in chunks, sizing each chunk before ``allocate`` claims the cached prefix (a misreading
    of ``allocate`` that would crash ``nanovllm bench``)."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running.values()):
            n = min(seq.num_uncomputed_tokens, budget)
            if n and self.block_manager.allocate(seq, n):
                out.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                break
            self.admit(self.waiting.popleft())
            out.add(seq, n)
            budget -= n
        return out


class SchedulesNothing(FifoScheduler):
    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput()


def scheduler_kit(cls: type) -> SchedulerConformance:
    return type("Kit", (SchedulerConformance,), {"scheduler_cls": cls})()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    "broken, check, message",
    [
        (IgnoresTokenBudget, "test_token_budget_and_max_num_seqs", "max_num_batched_tokens"),
        (IgnoresMaxNumSeqs, "test_token_budget_and_max_num_seqs", "max_num_seqs"),
        (Lifo, "test_no_starvation_under_a_stream_of_requests", "starved"),
        (FinishKeepsBlocks, "test_abort_anywhere_frees_blocks", "blocks"),
        (PreemptionKeepsComputedTokens, "test_preemption_under_kv_pressure_keeps_outputs",
         "not in the KV cache|PreemptionKeepsComputedTokens"),
        (MisreadsAllocate, "test_prefix_hits_with_chunked_admission_and_few_blocks", "MisreadsAllocate"),
        (SchedulesNothing, "test_token_budget_and_max_num_seqs", "empty step"),
    ],
)
def test_scheduler_kit_catches(broken: type, check: str, message: str, async_scheduling: bool) -> None:
    with pytest.raises(KitFailure, match=message):
        getattr(scheduler_kit(broken), check)(async_scheduling)


def test_scheduler_kit_catches_a_policy_that_ignores_the_prefix_cache() -> None:
    with pytest.raises(KitFailure, match="cached tokens"):
        scheduler_kit(NeverCachesBlocks).test_prefix_cache_hits_are_reported()


def test_scheduler_kit_catches_a_scheduler_that_is_not_a_scheduler() -> None:
    with pytest.raises(AssertionError, match="not a subclass of nanovllm_core.Scheduler"):
        scheduler_kit(dict).test_is_a_scheduler()


# --- block managers with one bug each ---------------------------------------------------------------


class LeaksTheLastBlock(PrefixCachingBlockManager):
    def free(self, seq) -> None:
        if seq.block_table:
            seq.block_table = seq.block_table[:-1]
        super().free(seq)


class PartialAllocate(PrefixCachingBlockManager):
    """Takes the blocks it can get before finding out there are not enough."""

    def allocate(self, seq, num_new_tokens: int) -> bool:
        ok = super().allocate(seq, num_new_tokens)
        if not ok and self.num_free_blocks and not seq.block_table:
            super().allocate(seq, self.num_free_blocks * self.block_size)
        return ok


class ForgetsRefCounts(PrefixCachingBlockManager):
    """Frees shared blocks on the first free, although another sequence still holds them."""

    def free(self, seq) -> None:
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count = 1
        super().free(seq)


def block_manager_kit(cls: type) -> BlockManagerConformance:
    return type("Kit", (BlockManagerConformance,), {"block_manager_cls": cls})()


@pytest.mark.parametrize(
    "broken, check, message",
    [
        (LeaksTheLastBlock, "test_allocate_covers_the_tokens_and_free_returns_every_block", "after free"),
        (LeaksTheLastBlock, "test_under_a_scheduler_with_shared_prefixes_and_kv_pressure", "leaked"),
        (PartialAllocate, "test_allocate_is_all_or_nothing", "changed state"),
        (ForgetsRefCounts, "test_prefix_cache_hit_is_the_shared_full_block_prefix", "must stay in use"),
        (ForgetsRefCounts, "test_under_a_scheduler_with_shared_prefixes_and_kv_pressure", "freed while in use"),
    ],
)
def test_block_manager_kit_catches(broken: type, check: str, message: str) -> None:
    with pytest.raises(KitFailure, match=message):
        getattr(block_manager_kit(broken), check)()


def test_scheduler_kit_needs_no_model_or_attention_plugin_and_says_what_a_skipped_check_needs(tmp_path) -> None:
    kit = type("Kit", (SchedulerConformance,), {"scheduler_cls": FifoScheduler, "block_manager_name": "nope"})()
    with pytest.raises(pytest.skip.Exception, match="block_manager 'nope', which is not installed"):
        kit.simulate(num_blocks=8)
    kit = type(
        "Kit", (SchedulerConformance,), {"scheduler_cls": FifoScheduler, "attention": "no-such-backend"}
    )()
    with pytest.raises(pytest.skip.Exception, match="attention backend 'no-such-backend'"):
        kit.test_engine_greedy_outputs_under_kv_pressure(tmp_path, False)
    kit.test_token_budget_and_max_num_seqs(False)  # the simulated checks run all the same
