from __future__ import annotations

import torch
from torch import nn

from nanovllm_core.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention of one layer; the selected backend does the work.

    The model runner assigns ``kv_cache`` (this layer's slice of the KV cache) after allocation.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        out = ctx.backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            ctx.metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
