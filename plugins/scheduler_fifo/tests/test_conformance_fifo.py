"""The conformance kit run against the in-tree ``fifo`` scheduler and ``prefix_cache`` block manager."""

from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager
from nanovllm_testing.conformance import BlockManagerConformance, SchedulerConformance


class TestFifoScheduler(SchedulerConformance):
    scheduler_cls = FifoScheduler
    block_manager_cls = PrefixCachingBlockManager


class TestPrefixCachingBlockManager(BlockManagerConformance):
    block_manager_cls = PrefixCachingBlockManager
    scheduler_cls = FifoScheduler
