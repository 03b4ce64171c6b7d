"""Entry point of the ``nanovllm`` group: registers the ``xgrammar`` structured-output backend."""

from nanovllm_core import hookimpl
from nanovllm_structured_xgrammar.backend import XgrammarBackend

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_structured_output_backends(register):
    register("xgrammar", XgrammarBackend)
