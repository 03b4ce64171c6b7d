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

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import wrap_kernel


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the kernel: output tile, K step, K slices, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name}={value}: a power of two of at least 16")
        if self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k={self.split_k}: at least 1")

    def short(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"
        )


def _gemm_kernel(
    X,
    W,
    Y,
    PARTIAL,
    COUNTS,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
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
    for i in range(0, k_per_split // BLOCK_K):
        k = k_start + i * BLOCK_K
        if EVEN_K:
            a = tl.load(x_ptrs, mask=rows, other=0.0)
            b = tl.load(w_ptrs, mask=cols, other=0.0)
        else:
            in_k = (k + offs_k)[None, :] < K
            a = tl.load(x_ptrs, mask=rows & in_k, other=0.0)
            b = tl.load(w_ptrs, mask=cols & in_k, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
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
    """Per-device float32 partial tiles and int32 tile counters (zeros), grown on demand, never shrunk.

    The engine compiles and runs every configured GEMM once before capturing CUDA graphs, so the buffers are
    at their final size before any graph records their addresses."""

    def __init__(self) -> None:
        self.partial: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, partial_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        partial = self.partial.get(device)
        if partial is None or partial.numel() < partial_elems:
            partial = self.partial[device] = torch.empty(max(partial_elems, 1), dtype=torch.float32, device=device)
        counts = self.counts.get(device)
        if counts is None or counts.numel() < tiles:
            if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the GEMM's tile counters must be allocated before CUDA graph capture")
            counts = self.counts[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        return partial, counts


_WORKSPACE = _Workspace()


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``x``: ``[M, K]``, ``weight``: ``[N, K]``, both with unit stride along K) in ``x``'s
    dtype, accumulated in float32. CPU tensors run Triton's interpreter (slow: tests only)."""
    if x.dim() != 2 or weight.dim() != 2 or x.size(1) != weight.size(1):
        raise ValueError(f"gemm: x [M, K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemm: x and weight need unit stride along K")
    m, k = x.shape
    n = weight.size(0)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = config
    k_steps = triton.cdiv(k, c.block_k)
    split = min(c.split_k, k_steps)
    k_per_split = triton.cdiv(k_steps, split) * c.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), split)
    tiles = grid[0] * grid[1]
    partial, counts = _WORKSPACE.get(x.device, split * tiles * c.block_m * c.block_n if split > 1 else 0, tiles)
    _kernel(x.device.type != "cuda")[grid](
        x, weight, out, partial, counts, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=split, EVEN_K=k % k_per_split == 0,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out
