"""The scheduler kit's forced-preemption and mixed-step scenarios catch policies with one bug each."""

from __future__ import annotations

import pytest
from kit_helpers import KitFailure, PreemptionKeepsComputedTokens
from nanovllm_scheduler_fifo import FifoScheduler
from nanovllm_testing.conformance import SchedulerConformance

from nanovllm_core import Scheduler, SchedulerOutput


class PreemptionDropsBlocksUnfreed(FifoScheduler):
    """Forgets a preempted sequence's blocks instead of freeing them."""

    def preempt(self, seq) -> None:
        seq.block_table = []
        super().preempt(seq)


class DecodeTokensOutsideTheBudget(Scheduler):
    """Decode-first, but only prompt chunks are counted against the token budget."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running.values()):
            decoding = seq.num_uncomputed_tokens == 1
            n = self.allocate_chunk(seq, 1 if decoding else budget)
            if n:
                out.add(seq, n)
                budget -= 0 if decoding else n
        for seq in list(self.waiting)[: self.max_num_seqs - len(self.running)]:
            n = self.allocate_chunk(seq, budget) if budget > 0 else 0
            if not n:
                break
            self.waiting.remove(seq)
            self.admit(seq)
            out.add(seq, n)
            budget -= n
        return out


def kit(cls: type) -> SchedulerConformance:
    return type("Kit", (SchedulerConformance,), {"scheduler_cls": cls})()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "broken, check, message",
    [
        (PreemptionKeepsComputedTokens, "test_forced_preemption_frees_the_victims_blocks", "computed tokens"),
        (PreemptionDropsBlocksUnfreed, "test_forced_preemption_frees_the_victims_blocks", "empty step|leaked"),
        (DecodeTokensOutsideTheBudget, "test_limits_hold_when_decodes_and_prompt_chunks_share_steps",
         "max_num_batched_tokens"),
    ],
)
def test_scheduler_kit_catches(broken: type, check: str, message: str, async_scheduling: bool) -> None:
    with pytest.raises(KitFailure, match=message):
        getattr(kit(broken), check)(async_scheduling)


@pytest.mark.parametrize("check", ["test_forced_preemption_frees_the_victims_blocks",
                                   "test_limits_hold_when_decodes_and_prompt_chunks_share_steps"])
def test_the_scenarios_pass_for_fifo(check: str) -> None:
    getattr(kit(FifoScheduler), check)(False)
