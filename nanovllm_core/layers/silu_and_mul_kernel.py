"""``silu(gate) * up`` in one Triton kernel (imports ``triton``: import it lazily).

``torch.compile(dynamic=True)`` fuses :func:`~nanovllm_core.layers.fused.silu_and_mul` into one kernel too, but
over a flat index into ``[tokens, intermediate]``: a 64-bit division and remainder by the symbolic width for
every element, which keeps that kernel well below the memory's copy rate on the large prompt and decode steps
where it matters. Here a program handles ``BLOCK`` contiguous columns of one row: no division, 16-byte loads.

The arithmetic is eager PyTorch's: SiLU in float32 rounded to the input dtype, then the product in float32
rounded again (``F.silu(gate) * up`` on 16-bit tensors), so the CPU path and this kernel agree up to the
exponential's last bit.

Like the other kernels (``sampling_kernel``), the body is a plain function wrapped on first use as a compiled
``JITFunction`` (CUDA tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's interpreter, for tests).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

MAX_BLOCK = 1024  # columns a program: 8 a thread at 4 warps, one 16-byte load each of gate and up in 16-bit


def _silu_and_mul_kernel(X, OUT, width, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block): ``OUT[row, c] = silu(X[row, c]) * X[row, width + c]``."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> object:
    return wrap_kernel(_silu_and_mul_kernel, interpret)


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` takes ``x``: an even, contiguous last dimension."""
    return x.dim() >= 1 and x.size(-1) % 2 == 0 and x.stride(-1) == 1


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` of last dimension ``2n`` (the last dimension contiguous).

    CUDA tensors run the compiled kernel, without synchronising with the host; anything else runs the same
    kernel in Triton's interpreter (slow: tests only). Returns a new contiguous tensor of last dimension ``n``.
    """
    if x.size(-1) % 2:
        raise ValueError(f"the last dimension holds [gate, up] and must be even, got {x.size(-1)}")
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    width = x.size(-1) // 2
    rows = x.reshape(-1, x.size(-1))  # a view for the GEMM outputs this gets; a copy only for odd layouts
    out = torch.empty((rows.size(0), width), dtype=x.dtype, device=x.device)
    if rows.size(0) and width:
        block = min(MAX_BLOCK, triton.next_power_of_2(width))
        _kernel(x.device.type != "cuda")[(rows.size(0), triton.cdiv(width, block))](
            rows,
            out,
            width,
            rows.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4 if block >= 512 else 1,
            **launch_options(x),
        )
    return out.view(*x.shape[:-1], width)
