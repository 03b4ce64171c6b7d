"""Entry point of the ``nanovllm`` group: registers the attention backends.

Importing this module needs neither ``triton`` nor ``flash_attn``: those are imported when a backend is
checked or built, so the plugin loads everywhere and ``check_available`` explains what is missing.
"""

from nanovllm_attention_flash.flash_attn_backend import FlashAttnBackend
from nanovllm_attention_flash.torch_backend import TorchAttentionBackend
from nanovllm_attention_flash.triton_backend import TritonAttentionBackend
from nanovllm_core import hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_attention_backends(register):
    register("torch", TorchAttentionBackend)
    register("triton", TritonAttentionBackend)
    register("flash_attn", FlashAttnBackend)
