"""Entry point of the ``nanovllm`` group: registers the ``flashinfer`` attention backend.

Importing this module does not import ``flashinfer``: the plugin loads everywhere and ``check_available`` explains
what is missing.
"""

from nanovllm_attention_flashinfer.backend import FlashInferBackend
from nanovllm_core import hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_attention_backends(register):
    register("flashinfer", FlashInferBackend)
