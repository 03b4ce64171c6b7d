from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanovllm_core.errors import ModelLoadError
from nanovllm_core.layers.fused import apply_rotary


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" layout (GPT-NeoX / Llama / Qwen)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: [tokens, heads, head_dim], ``k``: [tokens, kv_heads, head_dim]."""
        return apply_rotary(positions, q, k, self.cos_sin_cache, self.rotary_dim)


def rope_theta_of(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelLoadError("config.json gives no rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: 'default'")
    return float(theta)


def get_rope(head_dim: int, max_position: int, hf_config: Any) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, head_dim, max_position, rope_theta_of(hf_config))
