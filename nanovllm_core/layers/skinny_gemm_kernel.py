"""``x @ w.T`` for a few rows of ``x`` in one Triton kernel (imports ``triton``: import it lazily).

A decode step with a handful of running sequences multiplies a few activation rows by every weight matrix:
the step is a stream of weight reads, and its time should be the weights' bytes at the memory's copy rate.
cuBLAS picks tile shapes made for many rows there (a tile of 64 or more output columns, split-K and a reduce
kernel on narrow matrices), which launch too few programs to keep the memory busy on a small model's matrices.
Here a program owns ``BLOCK_N`` output columns for all rows: it reads its ``BLOCK_N x K`` slice of the weight
once, in ``BLOCK_K`` chunks, and accumulates in float32; the grid has enough programs to fill the GPU without
split-K. Rows are padded to ``M_PAD`` (a power of two) inside the kernel, never in memory.

Since every program loads the whole input rows anyway, two neighbours fold into it: the SiLU-and-mul after a
gate-up projection (``silu_mul``) and the residual add and RMSNorm before a projection
(:func:`skinny_norm_linear`), each without writing the intermediate rows and rounded as the separate kernels
round.

Like the other kernels (``silu_and_mul_kernel``), the body is a plain function wrapped on first use as a compiled
``JITFunction`` (CUDA tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's interpreter, for tests).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

# Where this kernel beats cuBLAS on an H200 (``benchmarks/decode_gemm.py --sweep``): a few rows of a small model's
# matrices. With more rows cuBLAS's tensor-core tiles reuse each weight tile enough to win; a large matrix keeps
# enough of cuBLAS's tiles in flight to read at the copy rate.
MAX_ROWS = 4
MAX_WEIGHT_ELEMENTS = 8 << 20


def _skinny_gemm_kernel(
    X, W, Y, RES, NW, RES_OUT, M, N, K, stride_x, stride_r, stride_w, stride_y, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ONE_CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``pid``: ``Y[:M, cols] = X[:M] @ W[cols].T`` for the ``BLOCK_N`` columns ``cols`` it owns.

    ``SILU_MUL``: ``W`` holds ``[gate; up]`` (``2N`` rows) and ``Y[:M, cols] = silu(X @ W[cols].T) * (X @
    W[N + cols].T)``, rounded as the separate GEMM and ``silu_and_mul_kernel`` round: the product once to the
    output dtype, SiLU in float32 rounded again, then their product in float32.

    ``NORM``: the rows multiplied are ``NW * rms_norm(X [+ RES])``, rounded as ``rms_norm_kernel`` rounds them;
    every program first sums the rows' squares over ``K`` (the rows are tiny and stay in cache), then normalises
    each chunk as it loads it; with ``ONE_CHUNK`` (``K <= BLOCK_K``) the rows are loaded once, for both. With
    ``HAS_RESIDUAL`` program 0 also writes ``RES_OUT = X + RES`` (contiguous)."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    w_ptrs = W + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    up_ptrs = w_ptrs + N * stride_w
    x_ptrs = X + rows[:, None] * stride_x + ks[None, :]
    r_ptrs = RES + rows[:, None] * stride_r + ks[None, :]
    if NORM and not ONE_CHUNK:
        squares = tl.full([M_PAD, BLOCK_K], 0.0, dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x_ok = row_ok[:, None] & ((k + ks) < K)[None, :]
            x = tl.load(x_ptrs + k, mask=x_ok, other=0.0)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(r_ptrs + k, mask=x_ok, other=0.0).to(tl.float32)).to(x.dtype)
                if pid == 0:
                    tl.store(RES_OUT + rows[:, None] * K + (k + ks)[None, :], x, mask=x_ok)
            squares += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.rsqrt(tl.reduce(squares, 1, tl.standard._sum_combine) / K + eps)[:, None]
    acc = tl.full([M_PAD, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([M_PAD, BLOCK_N], 0.0, dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:  # K and N are multiples of the blocks: unmasked, vectorised weight loads
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(r_ptrs + k, mask=row_ok[:, None], other=0.0)
            if NORM:
                norm_weight = tl.load(NW + k + ks)
            w = tl.load(w_ptrs + k)
            if SILU_MUL:
                up = tl.load(up_ptrs + k)
        else:
            k_ok = (k + ks) < K
            w_ok = col_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(r_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                norm_weight = tl.load(NW + k + ks, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs + k, mask=w_ok, other=0.0)
            if SILU_MUL:
                up = tl.load(up_ptrs + k, mask=w_ok, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            if ONE_CHUNK and pid == 0:
                tl.store(RES_OUT + rows[:, None] * K + ks[None, :], x, mask=row_ok[:, None] & (ks < K)[None, :])
        if NORM:
            if ONE_CHUNK:  # the same sum as the first pass over its one chunk
                rstd = tl.rsqrt(tl.reduce(x.to(tl.float32) * x.to(tl.float32), 1, tl.standard._sum_combine) / K + eps)
                rstd = rstd[:, None]
            normed = (x.to(tl.float32) * rstd).to(x.dtype)
            x = (norm_weight.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)
        x = x.to(tl.float32)[:, None, :]
        acc += tl.reduce(x * w.to(tl.float32)[None, :, :], 2, tl.standard._sum_combine)
        if SILU_MUL:
            acc_up += tl.reduce(x * up.to(tl.float32)[None, :, :], 2, tl.standard._sum_combine)
    out_dtype = Y.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        acc = silu * acc_up.to(out_dtype).to(tl.float32)
    y_ptrs = Y + rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(out_dtype), mask=row_ok[:, None] & col_ok[None, :])


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> object:
    return wrap_kernel(_skinny_gemm_kernel, interpret)


def launch_config(rows: int, out_features: int, in_features: int) -> dict[str, int]:
    """Block sizes and warps for ``rows`` rows of a ``[out_features, in_features]`` weight: the fastest of the
    sweep on the Qwen3-0.6B's projections. Many small programs (two or four columns each, two warps) beat fewer
    large ones: each SM keeps several programs' loads in flight."""
    m_pad = triton.next_power_of_2(max(rows, 1))
    block_k = min(1024, triton.next_power_of_2(in_features))
    return {"M_PAD": m_pad, "BLOCK_N": 2 if m_pad <= 2 else 4, "BLOCK_K": block_k, "num_warps": 2}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` takes these and is the faster choice: at most ``MAX_ROWS`` rows, a weight of at
    most ``MAX_WEIGHT_ELEMENTS``, 16-bit, last dimensions contiguous."""
    return (
        x.dim() >= 1
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
        and x.numel() <= MAX_ROWS * x.size(-1)
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: dict[str, int] | None = None, silu_mul: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x`` of at most ``MAX_ROWS`` rows (any leading shape), accumulated in float32.

    ``silu_mul``: ``weight`` holds ``[gate; up]`` and the result is ``silu(gate) * up`` (half the weight's rows
    wide), as ``silu_and_mul_kernel`` computes it from the full product, without writing that product.
    CUDA tensors run the compiled kernel; anything else runs it in Triton's interpreter (slow: tests only).
    ``config`` overrides :func:`launch_config` (benchmarks sweep it)."""
    return _launch(x, weight, config, silu_mul, None, 0.0, None)[0]


def skinny_norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(skinny_linear(h, weight, silu_mul=silu_mul), x + residual)`` with ``h = norm_weight * rms_norm(x +
    residual)``, in one kernel: the add and the norm rounded as ``rms_norm_kernel.rms_norm`` rounds them, the
    normalised rows never written. Without ``residual`` the second result is ``x`` itself, as ``RMSNorm`` leaves
    the residual. ``residual`` has ``x``'s shape and dtype (last dimension contiguous), ``norm_weight`` is ``x``'s
    width of its dtype."""
    width = x.size(-1)
    if not weight.size(0):
        raise ValueError("skinny_norm_linear needs a weight of at least one output row, got 0")
    if norm_weight.shape != (width,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(
            f"norm_weight must be a contiguous ({width},) tensor of {x.dtype}, got {tuple(norm_weight.shape)} "
            f"{norm_weight.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)} and dtype {x.dtype} with a contiguous last dimension, "
            f"got {tuple(residual.shape)} {residual.dtype} strides {residual.stride()}"
        )
    y, residual_out = _launch(x, weight, config, silu_mul, norm_weight, eps, residual)
    return y, x if residual_out is None else residual_out.view(x.shape)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: dict[str, int] | None,
    silu_mul: bool,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The product and, with ``norm_weight`` and ``residual``, the new residual rows ``[m, in_features]``."""
    out_features, in_features = weight.shape
    if x.size(-1) != in_features:
        raise ValueError(f"x has {x.size(-1)} features, the weight takes {in_features}")
    if silu_mul and out_features % 2:
        raise ValueError(f"silu_mul needs a [gate; up] weight of an even number of rows, got {out_features}")
    width = out_features // 2 if silu_mul else out_features
    rows = x.reshape(-1, in_features)
    m = rows.size(0)
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    norm = norm_weight is not None
    res = residual.reshape(-1, in_features) if norm and residual is not None else None
    res_out = torch.empty((m, in_features), dtype=x.dtype, device=x.device) if res is not None else None
    if m and width:
        cfg = dict(config or launch_config(m, width, in_features))
        even = in_features % cfg["BLOCK_K"] == 0 and width % cfg["BLOCK_N"] == 0
        # one row: the separate pass for the norm measured faster on an H200 (decode_gemm.py --norm), even when
        # the row fits one chunk; two to four rows: loading them once is
        one_chunk = in_features <= cfg["BLOCK_K"] and cfg["M_PAD"] > 1
        _kernel(x.device.type != "cuda")[(triton.cdiv(width, cfg["BLOCK_N"]),)](
            rows, weight, y, rows if res is None else res, norm_weight if norm else rows,
            rows if res_out is None else res_out,  # unused pointers stand in for the inputs a launch lacks
            m, width, in_features, rows.stride(0), 0 if res is None else res.stride(0), weight.stride(0),
            y.stride(0), eps, EVEN=even, SILU_MUL=silu_mul, NORM=norm, HAS_RESIDUAL=res is not None,
            ONE_CHUNK=one_chunk, **cfg, **launch_options(x),
        )  # fmt: skip
    return y.view(*x.shape[:-1], width), res_out
