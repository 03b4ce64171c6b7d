"""The ``shortest_prompt_first`` scheduler for nanovllm: an example of an out-of-tree plugin."""

from nanovllm_scheduler_spf.scheduler import ShortestPromptFirstScheduler

__version__ = "0.1.0"
__all__ = ["ShortestPromptFirstScheduler"]
