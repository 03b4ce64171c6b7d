import torch
from torch import nn

from nanovllm_core.layers.fused import fused_enabled, silu_and_mul
from nanovllm_core.layers.triton_jit import kernel_module


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for a tensor holding ``[gate, up]`` along its last dimension.

    With fused small ops on CUDA (``compile_small_ops``) a hand-written Triton kernel runs it (see
    ``silu_and_mul_kernel``: ``torch.compile``'s own fusion moved a third of the copy rate); elsewhere the same
    arithmetic runs in eager PyTorch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernel_module("silu_and_mul_kernel") if x.is_cuda and fused_enabled() else None
        if kernel is not None and kernel.supports(x):
            return kernel.silu_and_mul(x)
        return silu_and_mul(x)
