from serial_scheduler import SerialScheduler

from nanovllm_core.testing.conformance import SchedulerConformance


class TestSerialScheduler(SchedulerConformance):
    scheduler_cls = SerialScheduler
