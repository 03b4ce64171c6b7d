"""RMSNorm, with or without the residual add before it, in one Triton kernel (imports ``triton``: import it
lazily).

``torch.compile`` fuses :func:`~nanovllm_core.layers.fused.add_rms_norm` too, but for wide rows (Qwen3-8B's
4,096) it emits a looped reduction that reads each row twice, and a decode step runs two of these a layer. Here
a program holds one whole row in registers: one read of ``x`` (and the residual), one write of the output (and
the new residual).

The arithmetic is eager PyTorch's (:func:`~nanovllm_core.layers.fused.add_rms_norm`): the add rounded to the
input dtype, the mean of squares and ``rsqrt`` in float32, the normalised row rounded to the dtype, then the
product with the weight rounded again.

Like the other kernels (``sampling_kernel``), the body is a plain function wrapped on first use as a compiled
``JITFunction`` (CUDA tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's interpreter, for tests).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

MAX_WIDTH = 16384  # one row a program, held in registers: 32 values a thread at 16 warps


def _rms_norm_kernel(
    X,
    RESIDUAL,
    WEIGHT,
    OUT,
    RESIDUAL_OUT,
    width,
    eps,
    stride_x,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program per row: ``OUT = weight * rms_norm(x [+ residual])``; with a residual also ``RESIDUAL_OUT = x +
    residual``. ``OUT`` and ``RESIDUAL_OUT`` are contiguous rows of ``width``."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(RESIDUAL + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(RESIDUAL_OUT + row * width + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / width
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(WEIGHT + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(OUT + row * width + cols, out.to(OUT.dtype.element_ty), mask=mask)


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> object:
    return wrap_kernel(_rms_norm_kernel, interpret)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rms_norm` takes these tensors: rows ``[tokens, width]`` (last dimension contiguous, at most
    ``MAX_WIDTH``), a weight of their dtype, a residual of their shape and dtype."""
    ok = x.dim() == 2 and x.stride(-1) == 1 and 0 < x.size(-1) <= MAX_WIDTH
    ok = ok and weight.shape == (x.size(-1),) and weight.dtype == x.dtype and weight.is_contiguous()
    if residual is not None:
        ok = ok and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return ok


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * rms_norm(x)``, or with ``residual`` ``(weight * rms_norm(x + residual), x + residual)``.

    Tensors as :func:`supports` says (raises ``ValueError`` otherwise). CUDA tensors run the compiled kernel,
    without synchronising with the host; anything else runs the same kernel in Triton's interpreter (slow:
    tests only). Returns new contiguous tensors.
    """
    if not supports(x, weight, residual):
        raise ValueError(
            f"rms_norm takes rows [tokens, width <= {MAX_WIDTH}] with a contiguous last dimension and a weight "
            f"(and residual) of their dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}" + (f", residual {tuple(residual.shape)} {residual.dtype}" if residual is not None else "")
        )
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(width)
        _kernel(x.device.type != "cuda")[(rows,)](
            x,
            residual if residual is not None else x,  # unread without a residual
            weight,
            out,
            residual_out,
            width,
            eps,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
            **launch_options(x),
        )
    return out if residual is None else (out, residual_out)
