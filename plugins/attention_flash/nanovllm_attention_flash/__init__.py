"""Paged attention backends for nanovllm: ``flash_attn`` (flash-attn-4), ``triton`` (own kernels), ``torch``.

Importing the package needs neither ``triton`` nor ``flash_attn``.
"""

from nanovllm_attention_flash.flash_attn_backend import FlashAttnBackend
from nanovllm_attention_flash.torch_backend import TorchAttentionBackend, store_kv_cache
from nanovllm_attention_flash.triton_backend import TritonAttentionBackend

__version__ = "0.1.0"
__all__ = ["FlashAttnBackend", "TorchAttentionBackend", "TritonAttentionBackend", "store_kv_cache"]
