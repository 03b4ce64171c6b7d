"""The ``mixed`` scheduler: decode tokens first, then prompt chunks of any number of waiting requests."""

from nanovllm_scheduler_mixed.scheduler import MixedScheduler

__version__ = "0.1.0"
__all__ = ["MixedScheduler"]
