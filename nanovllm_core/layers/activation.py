import functools
from types import ModuleType

import torch
from torch import nn

from nanovllm_core.layers.fused import fused_enabled, silu_and_mul


@functools.cache
def _triton_kernel() -> ModuleType | None:
    """The Triton SiLU-and-mul module, or None without triton (the core does not depend on it)."""
    try:
        from nanovllm_core.layers import silu_and_mul_kernel
    except ImportError:
        return None
    return silu_and_mul_kernel


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for a tensor holding ``[gate, up]`` along its last dimension.

    With fused small ops on CUDA (``compile_small_ops``) a hand-written Triton kernel runs it (see
    ``silu_and_mul_kernel``: ``torch.compile``'s own fusion moved a third of the copy rate); elsewhere the same
    arithmetic runs in eager PyTorch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_enabled() and (kernel := _triton_kernel()) is not None and kernel.supports(x):
            return kernel.silu_and_mul(x)
        return silu_and_mul(x)
