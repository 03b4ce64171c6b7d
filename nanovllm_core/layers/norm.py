import torch
from torch import nn

from nanovllm_core.layers.fused import add_rms_norm, fused_enabled, rms_norm
from nanovllm_core.layers.triton_jit import kernel_module


class RMSNorm(nn.Module):
    """RMS normalisation in float32; with ``residual`` it adds first and returns ``(normed, new_residual)``.

    With fused small ops on CUDA (``compile_small_ops``) rows of hidden states run a hand-written Triton kernel
    (see ``rms_norm_kernel``); everything else the same arithmetic through ``torch.compile`` or eagerly.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernel = kernel_module("rms_norm_kernel") if x.is_cuda and fused_enabled() else None
        if kernel is not None and kernel.supports(x, self.weight, residual):
            return kernel.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
