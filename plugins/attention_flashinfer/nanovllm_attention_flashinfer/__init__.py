"""The ``flashinfer`` attention backend for nanovllm: FlashInfer's paged prefill and decode kernels.

Importing the package needs neither ``flashinfer`` nor ``triton``; ``layout`` (FlashInfer's page table built from
the engine's step metadata) is plain PyTorch.
"""

from nanovllm_attention_flashinfer.backend import FlashInferBackend
from nanovllm_attention_flashinfer.layout import GraphLayout, PagedKVLayout, paged_kv_views, step_layout

__version__ = "0.1.0"
__all__ = ["FlashInferBackend", "GraphLayout", "PagedKVLayout", "paged_kv_views", "step_layout"]
