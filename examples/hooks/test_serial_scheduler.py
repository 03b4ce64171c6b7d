from nanovllm_testing.conformance import SchedulerConformance
from serial_scheduler import SerialScheduler


class TestSerialScheduler(SchedulerConformance):
    scheduler_cls = SerialScheduler
