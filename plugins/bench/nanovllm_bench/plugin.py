"""Entry point of the ``nanovllm`` group: registers the commands ``bench`` (with its ``serve`` mode) and
``simulate``."""

from nanovllm_bench.commands import BenchCommand, SimulateCommand
from nanovllm_core import hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_commands(register):
    register("bench", BenchCommand)
    register("simulate", SimulateCommand)
