"""``y = x @ w.T`` for the few-row activations of decode steps, as one Triton kernel with an optional split of K
(imports ``triton``: import it lazily).

A decode step multiplies one activation row per running sequence by each weight matrix. With a few hundred rows
and a narrow output (the 0.6B shape's ``o`` and ``down`` projections have 1,024 columns), a GEMM cut into output
tiles alone has too few tiles to keep 132 SMs streaming weights; cuBLAS runs these at a fraction of the copy
rate. Here a program computes one ``BLOCK_M x BLOCK_N`` output tile over one of ``SPLIT_K`` slices of K. With
``SPLIT_K > 1`` each program writes its float32 partial tile to a workspace and counts itself in on the tile's
counter; the last of the tile's programs to arrive adds the partials in slice order (so the result does not
depend on arrival order: the same bits every run) and writes the output, then resets the counter for the next
call. One kernel a GEMM, as cuBLAS's, so a CUDA graph of a step keeps its length.

Like the other kernels, the body is a plain function wrapped on first use as a compiled ``JITFunction`` (CUDA
tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's interpreter, for tests).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.gemm_config import GemmConfig
from nanovllm_core.layers.triton_jit import wrap_kernel

__all__ = ["GemmConfig", "gemm"]


def _gemm_kernel(
    X,
    W,
    Y,
    PARTIAL,
    COUNTS,
    NORM_WEIGHT,
    RESIDUAL,
    RESIDUAL_OUT,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    k_per_split,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    pid_n = tl.program_id(0)  # output tiles along N first: neighbouring programs read the same x rows
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    rows = offs_m[:, None] < M
    cols = offs_n[:, None] < N
    x_ptrs = X + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = W + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    sum_sq = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    for i in range(0, k_per_split // BLOCK_K):
        k = k_start + i * BLOCK_K
        a_mask = rows
        b_mask = cols
        if not EVEN_K:
            in_k = (k + offs_k)[None, :] < K
            a_mask = rows & in_k
            b_mask = cols & in_k
        a = tl.load(x_ptrs, mask=a_mask, other=0.0)
        if PROLOGUE == "norm":  # RMSNorm(x [+ residual]) * weight: the row scale waits for the epilogue
            if HAS_RESIDUAL:
                res_offs = offs_m[:, None] * K + (k + offs_k)[None, :]
                a = (a.to(tl.float32) + tl.load(RESIDUAL + res_offs, mask=a_mask, other=0.0).to(tl.float32)).to(
                    X.dtype.element_ty
                )
                tl.store(RESIDUAL_OUT + res_offs, a, mask=a_mask & (offs_m[:, None] * 0 + pid_n == 0))  # once a row
            a32 = a.to(tl.float32)
            sum_sq += tl.reduce(a32 * a32, 1, tl.standard._sum_combine)
            g = tl.load(NORM_WEIGHT + k + offs_k, mask=(k + offs_k) < K, other=0.0).to(tl.float32)
            a = (a32 * g[None, :]).to(X.dtype.element_ty)
        elif PROLOGUE == "silu":  # x = [gate | up]: silu(gate) * up, K columns apart
            gate = a.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=a_mask, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty)
        b = tl.load(w_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PROLOGUE == "norm":
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    out_mask = rows & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        num_tiles = tl.num_programs(0) * tl.num_programs(1)
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(PARTIAL + (pid_k * num_tiles + tile) * (BLOCK_M * BLOCK_N) + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the tile's counter hears of it
        arrived = tl.atomic_add(COUNTS + tile, 1)  # acq_rel at GPU scope: the partials are visible in order
        if arrived == SPLIT_K - 1:
            total = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # slice order, whoever arrived last: the same sum every run
                part = PARTIAL + (s * num_tiles + tile) * (BLOCK_M * BLOCK_N) + local
                total += tl.load(part, cache_modifier=".cg")  # from L2: this SM's L1 may hold stale lines
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(COUNTS + tile, 0)  # ready for the next call (a CUDA graph replays this kernel)


@cache
def _kernel(interpret: bool):
    return wrap_kernel(_gemm_kernel, interpret)  # k_per_split, a multiple of 16, stays specialised: aligned loads


class _Workspace:
    """Per-device float32 partial tiles and int32 tile counters (zeros), grown on demand.

    A CUDA graph keeps the addresses it was captured with, so a buffer that grows is replaced but never freed:
    graphs captured before still use the old one (each graph bucket runs its model once eagerly before its
    capture, which is where the growth happens)."""

    def __init__(self) -> None:
        self.partial: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, partial_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        partial = self.partial.get(device)
        if partial is None or partial.numel() < partial_elems:
            if capturing:
                raise RuntimeError("the GEMM's workspace grew during CUDA graph capture: run the model eagerly first")
            if partial is not None:
                self.retired.append(partial)
            partial = self.partial[device] = torch.empty(max(partial_elems, 1), dtype=torch.float32, device=device)
        counts = self.counts.get(device)
        if counts is None or counts.numel() < tiles:
            if capturing:
                raise RuntimeError("the GEMM tile counters grew during CUDA graph capture: run the model eagerly first")
            if counts is not None:
                self.retired.append(counts)
            counts = self.counts[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        return partial, counts


_WORKSPACE = _Workspace()


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemmConfig,
    out: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T`` (``x``: ``[M, K]``, ``weight``: ``[N, K]``, both with unit stride along K) in ``x``'s
    dtype, accumulated in float32. CPU tensors run Triton's interpreter (slow: tests only).

    ``prologue`` transforms ``x`` on its way into the product:

    - ``"norm"``: ``RMSNorm(x + residual) * norm_weight`` (``residual`` optional), the row scale applied to the
      accumulator. Returns ``(y, x + residual)`` (``x`` itself without a residual), as a fused add-and-norm
      layer does. Needs ``config.split_k == 1``: the scale needs the whole row.
    - ``"silu"``: ``x`` is ``[M, 2K]``, gate then up: ``silu(gate) * up`` (SwiGLU's activation).
    """
    if prologue not in ("none", "norm", "silu"):
        raise ValueError(f"gemm: prologue {prologue!r} is not one of 'none', 'norm', 'silu'")
    k = weight.size(1) if weight.dim() == 2 else -1
    x_k = x.size(1) // 2 if prologue == "silu" and x.dim() == 2 else (x.size(1) if x.dim() == 2 else -2)
    if x.dim() != 2 or weight.dim() != 2 or x_k != k or (prologue == "silu" and x.size(1) != 2 * k):
        what = "x [M, 2K] (gate, up)" if prologue == "silu" else "x [M, K]"
        raise ValueError(f"gemm: {what} and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemm: x and weight need unit stride along K")
    if prologue == "norm":
        if config.split_k != 1:
            raise ValueError(f"gemm: prologue 'norm' needs split_k=1 (the config has split_k={config.split_k})")
        if norm_weight is None or norm_weight.shape != (k,):
            raise ValueError(f"gemm: prologue 'norm' needs norm_weight of shape ({k},)")
        if residual is not None and (residual.shape != x.shape or not residual.is_contiguous() or x.stride(0) != k):
            raise ValueError("gemm: residual must be contiguous and of x's shape, and x contiguous")
    m, n = x.size(0), weight.size(0)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if prologue == "norm" and residual is not None else x
    if m == 0:
        return (out, residual_out) if prologue == "norm" else out
    c = config
    k_steps = triton.cdiv(k, c.block_k)
    split = min(c.split_k, k_steps)
    k_per_split = triton.cdiv(k_steps, split) * c.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), split)
    tiles = grid[0] * grid[1]
    partial, counts = _WORKSPACE.get(x.device, split * tiles * c.block_m * c.block_n if split > 1 else 0, tiles)
    _kernel(x.device.type != "cuda")[grid](
        x, weight, out, partial, counts, norm_weight if norm_weight is not None else x,
        residual if residual is not None else x, residual_out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        k_per_split, eps, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=split,
        EVEN_K=k % k_per_split == 0, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, num_warps=c.num_warps,
        num_stages=c.num_stages,
    )  # fmt: skip
    return (out, residual_out) if prologue == "norm" else out
