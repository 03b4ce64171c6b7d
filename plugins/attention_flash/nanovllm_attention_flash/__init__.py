"""Paged attention backends for nanovllm."""

from nanovllm_attention_flash.torch_backend import TorchAttentionBackend, store_kv_cache

__version__ = "0.1.0"
__all__ = ["TorchAttentionBackend", "store_kv_cache"]
