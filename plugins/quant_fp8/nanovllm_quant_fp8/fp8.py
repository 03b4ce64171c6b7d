"""FP8 e4m3 arithmetic in plain torch: quantizing weights and activations, dequantizing, the reference product.

Two weight layouts, both ``w ~= wq * scale``:

- per output channel: ``scale`` is ``[N]`` float32, one per row of ``w`` ``[N, K]`` (compressed-tensors' ``channel``
  strategy, and what ``--quantization fp8`` makes of a bf16 checkpoint);
- blocks of ``block = (BN, BK)`` (Qwen's and DeepSeek's FP8 releases, ``weight_block_size``): ``scale`` is
  ``[ceil(N / BN), ceil(K / BK)]``, one per tile (the checkpoints call it ``weight_scale_inv``; it multiplies).

Activations are quantized dynamically, per token (a scale per row) or per group of ``group_size`` columns of a
row (the block layout's ``1 x BK`` groups), so that every product of the GEMM has one activation scale and one
weight scale. These functions are the contract the CUDA kernels are checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor

Block = tuple[int, int] | None
"""A block scale's tile ``(BN, BK)``, or None for a scale per output channel."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or block gets this scale instead of 0 (no division by zero, zeros stay zeros)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel(
    weight: torch.Tensor, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wq, scale)``: ``wq`` float8 e4m3 ``[N, K]``, ``scale`` float32 ``[N]``, each row scaled to its largest
    magnitude (``row_amax`` when given: a row-parallel shard scales to its whole row's, across ranks)."""
    amax = weight.abs().amax(dim=1).float() if row_amax is None else row_amax
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(weight, scale[:, None]), scale


def _tile(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A block scale ``[ceil(N / BN), ceil(K / BK)]`` repeated over its tiles and cut to ``shape`` ``[N, K]``."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def quantize_weight_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wq, scale)`` with one float32 scale per ``block`` tile (the last tiles may be partial), as Qwen's FP8
    releases are made."""
    n, k = weight.shape
    bn, bk = block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(padded.size(0) // bn, bn, padded.size(1) // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(weight, _tile(scale, block, weight.shape)), scale


def dequantize_weight(
    wq: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``wq * scale`` in ``dtype``: per output channel (``block`` None, ``scale`` ``[N]`` or ``[N, 1]``) or per
    ``block`` tile."""
    if block is None:
        full = scale.float().reshape(-1, 1)
    else:
        full = _tile(scale.float(), block, wq.shape)
    return (wq.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of ``x`` ``[M, K]``: ``(xq, scale)`` with ``scale`` float32 ``[M, 1]`` (per token,
    ``group_size`` None) or ``[M, ceil(K / group_size)]`` (per ``1 x group_size`` group of a row)."""
    m, k = x.shape
    if group_size is None:
        scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
        return _to_fp8(x, scale), scale
    groups = -(-k // group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = (padded.view(m, groups, group_size).abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(x, scale.repeat_interleave(group_size, 1)[:, :k]), scale


def w8a8_reference(x: Tensor, wq: Tensor, w_scale: Tensor, block: Block = None, bias: Tensor | None = None) -> Tensor:
    """What the W8A8 kernels compute, in float32 then rounded to ``x``'s dtype: ``x`` quantized per token (per
    channel weights) or per ``1 x BK`` group (``block``), times the dequantized weight."""
    xq, x_scale = quantize_activation(x, None if block is None else block[1])
    if block is None:
        xd = xq.float() * x_scale
    else:
        xd = xq.float() * x_scale.repeat_interleave(block[1], 1)[:, : x.size(1)]
    return _times_dequantized(xd, wq, w_scale, block, bias, x.dtype)


def w8a16_reference(x: Tensor, wq: Tensor, w_scale: Tensor, block: Block = None, bias: Tensor | None = None) -> Tensor:
    """What the weight-only kernels compute (a decode step's few rows): ``x`` as it is times the dequantized
    weight, accumulated in float32, rounded to ``x``'s dtype."""
    return _times_dequantized(x.float(), wq, w_scale, block, bias, x.dtype)


def _times_dequantized(
    x: Tensor, wq: Tensor, w_scale: Tensor, block: Block, bias: Tensor | None, dtype: torch.dtype
) -> Tensor:
    y = x @ dequantize_weight(wq, w_scale, block).t()
    return (y if bias is None else y + bias.float()).to(dtype)
