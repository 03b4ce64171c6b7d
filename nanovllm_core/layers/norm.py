import torch
from torch import nn

from nanovllm_core.layers.fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMS normalisation in float32; with ``residual`` it adds first and returns ``(normed, new_residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
