"""The ``fifo`` scheduler and the ``prefix_cache`` block manager."""

from nanovllm_scheduler_fifo.block_manager import PrefixCachingBlockManager
from nanovllm_scheduler_fifo.scheduler import FifoScheduler

__version__ = "0.1.0"
__all__ = ["FifoScheduler", "PrefixCachingBlockManager"]
