"""Entry point of the ``nanovllm`` group: registers ``fifo`` and ``prefix_cache``."""

from nanovllm_core import hookimpl
from nanovllm_scheduler_fifo.block_manager import PrefixCachingBlockManager
from nanovllm_scheduler_fifo.scheduler import FifoScheduler

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_schedulers(register):
    register("fifo", FifoScheduler)


@hookimpl
def nanovllm_register_block_managers(register):
    register("prefix_cache", PrefixCachingBlockManager)
