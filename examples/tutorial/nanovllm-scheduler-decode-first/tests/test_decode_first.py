from nanovllm_decode_first.scheduler import DecodeFirstScheduler

from nanovllm_core.testing.conformance import SchedulerConformance


class TestDecodeFirst(SchedulerConformance):
    scheduler_cls = DecodeFirstScheduler
