"""Greedy output under ``mixed`` equals ``fifo``'s, token for token, in every regime (the core's parity kit), and
with a cap on prompt chunks."""

from __future__ import annotations

from nanovllm_testing.conformance import SchedulerParity


class TestMixedParity(SchedulerParity):
    scheduler_name = "mixed"
    extra_regimes = {"chunk-cap": ({"num_kvcache_blocks": 128}, {"long_prefill_token_threshold": 16})}
