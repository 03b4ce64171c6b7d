"""Entry point of the ``nanovllm`` group: registers the ``guidance`` structured-output backend."""

from nanovllm_core import hookimpl
from nanovllm_structured_llguidance.backend import GuidanceBackend

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_structured_output_backends(register):
    register("guidance", GuidanceBackend)
