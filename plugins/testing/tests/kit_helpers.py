"""What the conformance-kit tests share: the exceptions a failed check raises, and a scheduler with one bug that
two sets of checks must catch."""

from __future__ import annotations

import pytest
from nanovllm_scheduler_fifo import FifoScheduler

from nanovllm_core.errors import SchedulerError

KitFailure = (AssertionError, pytest.fail.Exception, SchedulerError)


class PreemptionKeepsComputedTokens(FifoScheduler):
    """Frees a preempted sequence's blocks but still believes its KV is cached."""

    def preempt(self, seq) -> None:
        computed = seq.num_computed_tokens
        super().preempt(seq)
        seq.num_computed_tokens = computed
