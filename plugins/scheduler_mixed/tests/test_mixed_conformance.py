"""The core's scheduler conformance kit, run against ``mixed`` (with and without a chunk cap)."""

from nanovllm_scheduler_mixed import MixedScheduler
from nanovllm_testing.conformance import SchedulerConformance


class TestMixedScheduler(SchedulerConformance):
    scheduler_cls = MixedScheduler


class TestMixedSchedulerWithChunkCap(SchedulerConformance):
    scheduler_cls = MixedScheduler
    scheduler_options = {"long_prefill_token_threshold": 8}
