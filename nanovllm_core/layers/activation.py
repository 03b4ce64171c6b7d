import torch
from torch import nn

from nanovllm_core.layers.fused import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for a tensor holding ``[gate, up]`` along its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
