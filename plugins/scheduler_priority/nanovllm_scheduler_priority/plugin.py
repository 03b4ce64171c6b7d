"""Entry point of the ``nanovllm`` group: registers the ``priority`` scheduler."""

from nanovllm_core import hookimpl
from nanovllm_scheduler_priority.scheduler import PriorityScheduler

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_schedulers(register):
    register("priority", PriorityScheduler)
