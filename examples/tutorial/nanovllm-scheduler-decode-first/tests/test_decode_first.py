from nanovllm_decode_first.scheduler import DecodeFirstScheduler
from nanovllm_testing.conformance import SchedulerConformance


class TestDecodeFirst(SchedulerConformance):
    scheduler_cls = DecodeFirstScheduler
