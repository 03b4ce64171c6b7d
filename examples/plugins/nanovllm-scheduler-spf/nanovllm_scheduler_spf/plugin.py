"""Entry point of the ``nanovllm`` group: registers the ``shortest_prompt_first`` scheduler."""

from nanovllm_core import hookimpl
from nanovllm_scheduler_spf.scheduler import ShortestPromptFirstScheduler

NANOVLLM_PLUGIN_API = ">=2,<3"


@hookimpl
def nanovllm_register_schedulers(register):
    register("shortest_prompt_first", ShortestPromptFirstScheduler)
