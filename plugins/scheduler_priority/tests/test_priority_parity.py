"""Greedy output under ``priority`` equals ``fifo``'s, token for token, in every regime (the core's parity kit),
with fast aging, and with priorities mixed with and without aging; no aging key outlives its request."""

from __future__ import annotations

from nanovllm_testing.conformance import SchedulerParity

PREEMPTED_CHUNKED = {"num_kvcache_blocks": 11, "max_num_batched_tokens": 40, "max_num_seqs": 8}


class TestPriorityParity(SchedulerParity):
    scheduler_name = "priority"
    extra_regimes = {
        "chunk-cap": ({"num_kvcache_blocks": 128}, {"long_prefill_token_threshold": 16}),
        "fast-aging": (PREEMPTED_CHUNKED, {"aging_steps": 1}),
    }
    priority_options = [{"aging_steps": 0}, {"aging_steps": 2}]

    def check_engine_after(self, llm) -> None:
        super().check_engine_after(llm)
        assert not llm.scheduler.keys, "aging keys left for finished requests"
