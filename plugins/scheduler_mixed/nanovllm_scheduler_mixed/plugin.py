"""Entry point of the ``nanovllm`` group: registers the ``mixed`` scheduler."""

from nanovllm_core import hookimpl
from nanovllm_scheduler_mixed.scheduler import MixedScheduler

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_schedulers(register):
    register("mixed", MixedScheduler)
