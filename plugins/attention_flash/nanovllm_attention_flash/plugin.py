"""Entry point of the ``nanovllm`` group: registers the attention backends."""

from nanovllm_core import hookimpl

from nanovllm_attention_flash.torch_backend import TorchAttentionBackend


@hookimpl
def nanovllm_register_attention_backends(register):
    register("torch", TorchAttentionBackend)
