"""The ``priority`` scheduler: ``SamplingParams.priority`` first, aging, decode-first chunked steps."""

from nanovllm_scheduler_priority.scheduler import PriorityScheduler

__version__ = "0.1.0"
__all__ = ["PriorityScheduler"]
