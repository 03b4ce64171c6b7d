"""The core's scheduler conformance kit, run against ``priority`` (default options; fast aging with a chunk cap)."""

from nanovllm_scheduler_priority import PriorityScheduler
from nanovllm_testing.conformance import SchedulerConformance


class TestPriorityScheduler(SchedulerConformance):
    scheduler_cls = PriorityScheduler


class TestPrioritySchedulerFastAgingAndChunkCap(SchedulerConformance):
    scheduler_cls = PriorityScheduler
    scheduler_options = {"aging_steps": 2, "long_prefill_token_threshold": 8}
