"""Fused mixture-of-experts on the GPU: a Triton grouped GEMM over tokens sorted by expert.

Steps of :func:`fused_experts`:

1. :func:`align_block_size` sorts the ``T * K`` (token, expert) pairs by expert and pads each expert's run
   of rows to a multiple of ``BLOCK_M``, so that every ``BLOCK_M`` rows belong to one expert.
2. ``_gate_up_silu_kernel``: for each block of rows, gathers the tokens' hidden states, multiplies them by
   the expert's gate and up weights (two accumulators) and writes ``silu(gate) * up`` per pair.
3. ``_down_kernel``: multiplies those rows by the expert's down weight and scales each row by its routing
   weight, writing one row per pair.
4. A sum over the ``K`` pairs of each token.

Every size is fixed by ``T``, ``K``, ``E`` and the block size (no host sync), so it can be captured in a
CUDA graph. This module imports Triton at import time; :mod:`nanovllm_models_qwen3.moe` imports it lazily.
It also runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoeKernelConfig:
    """Tile sizes and launch parameters shared by both kernels."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def kernel_config(num_pairs: int, num_experts: int) -> MoeKernelConfig:
    """Tiles by the average number of rows per expert: small ``BLOCK_M`` when each expert sees few tokens
    (decode: little padding, weight-bandwidth bound), large tiles when the GEMMs are big (prefill).
    Picked from a sweep at Qwen3-30B-A3B shapes (E=128, top-8, H=2048, I=768) on an H200."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 12:
        return MoeKernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 40:
        return MoeKernelConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 96:
        return MoeKernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    return MoeKernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


SMALL_ALIGN_MAX_PAIRS = 256
"""Up to this many (token, expert) pairs, :func:`align_block_size` runs as one Triton kernel (decode)."""


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert, each expert's rows padded to a multiple of ``block_m``.

    Returns ``sorted_pair_ids`` (int32 [R], the flat pair index ``t * K + k`` of each row, or ``T * K``
    for a padding row; pairs of one expert keep their order) and ``block_expert_ids`` (int32 [R / block_m],
    the expert of each block of rows, -1 for blocks past the last expert's rows). ``R`` is an upper bound
    that depends only on the shapes. ``use_kernel`` picks the single-kernel version (default: on CUDA for
    at most :data:`SMALL_ALIGN_MAX_PAIRS` pairs, where a dozen small PyTorch ops would cost more than the
    GEMMs); both give identical results.
    """
    num_pairs = topk_ids.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    sorted_pair_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    block_expert_ids = torch.empty(max_rows // block_m, dtype=torch.int32, device=topk_ids.device)
    if use_kernel is None:
        use_kernel = topk_ids.is_cuda and num_pairs <= SMALL_ALIGN_MAX_PAIRS
    if use_kernel:
        p_pow2 = triton.next_power_of_2(num_pairs)
        e_pow2 = triton.next_power_of_2(num_experts)
        _align_small_kernel[(1,)](
            topk_ids.reshape(-1).contiguous(),
            sorted_pair_ids,
            block_expert_ids,
            num_pairs,
            block_expert_ids.numel(),
            NUM_EXPERTS=num_experts,
            P_POW2=p_pow2,
            E_POW2=e_pow2,
            B_POW2=triton.next_power_of_2(block_expert_ids.numel()),
            BLOCK_M=block_m,
            num_warps=16 if p_pow2 * e_pow2 > 8192 else 4,
        )
        return sorted_pair_ids, block_expert_ids
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    count_starts = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - count_starts[sorted_experts]
    rows = padded_starts[sorted_experts] + rank_in_expert
    sorted_pair_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    owner = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert_ids.copy_(torch.where(owner < num_experts, owner, -1))
    return sorted_pair_ids, block_expert_ids


@triton.jit
def _align_small_kernel(
    ids_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    P_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    B_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """:func:`align_block_size` in one program, with [pairs, experts] one-hot matrices."""
    offs_p = tl.arange(0, P_POW2)
    p_mask = offs_p < num_pairs
    ids = tl.load(ids_ptr + offs_p, mask=p_mask, other=-1).to(tl.int32)
    onehot = (ids[:, None] == tl.arange(0, E_POW2)[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs of the same expert before this one
    rows = tl.sum(onehot * (starts[None, :] + earlier), axis=1)
    tl.store(sorted_pair_ids_ptr + rows, offs_p, mask=p_mask)
    offs_b = tl.arange(0, B_POW2)
    owner = tl.sum((ends[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
    owner = tl.where(owner < NUM_EXPERTS, owner, -1)
    tl.store(block_expert_ids_ptr + offs_b, owner, mask=offs_b < num_blocks)


@triton.jit
def _tile(sorted_pair_ids_ptr, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The grouped GEMMs' tile of program (m, n): its rows' pairs (int64) and mask (padding rows are past
    ``num_pairs``), its columns and their mask, and the K offsets."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, offs_n, offs_n < N, tl.arange(0, BLOCK_K)


@triton.jit
def _store_tile(out_ptr, values, pairs, m_mask, offs_n, n_mask, stride_om):
    """``out[pair, n] = values`` over the tile, in ``out``'s dtype."""
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, values.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_pairs,
    N,
    K: tl.constexpr,
    top_k: tl.constexpr,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """``out[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, N + n])`` for one tile of rows."""
    expert = tl.load(block_expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, m_mask, offs_n, n_mask, offs_k = _tile(sorted_pair_ids_ptr, num_pairs, N, BLOCK_M, BLOCK_N, BLOCK_K)
    tokens = pairs // top_k
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_iter in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k_iter * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    _store_tile(out_ptr, act, pairs, m_mask, offs_n, n_mask, stride_om)


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_pairs,
    N,
    K: tl.constexpr,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """``out[pair, n] = topk_weight[pair] * (a[pair] . w[e, n])`` for one tile of rows."""
    expert = tl.load(block_expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, m_mask, offs_n, n_mask, offs_k = _tile(sorted_pair_ids_ptr, num_pairs, N, BLOCK_M, BLOCK_N, BLOCK_K)
    a_ptrs = a_ptr + pairs[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_iter in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k_iter * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    _store_tile(out_ptr, acc, pairs, m_mask, offs_n, n_mask, stride_om)


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | None = None,
) -> torch.Tensor:
    """Same contract as :func:`nanovllm_models_qwen3.moe_torch.torch_experts`, computed with two Triton
    grouped GEMMs. Accumulates in float32 (float32 inputs multiply in full float32, not TF32); intermediate
    activations are stored in ``hidden_states.dtype``.
    ``config`` overrides the tile sizes (for tuning and tests)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_n, hidden = w13.shape
    inter = two_n // 2
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected {(num_experts, hidden, inter)}")
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    x = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    num_pairs = num_tokens * top_k
    cfg = config or kernel_config(num_pairs, num_experts)
    sorted_pair_ids, block_expert_ids = align_block_size(topk_ids, num_experts, cfg.block_m)
    num_blocks = block_expert_ids.numel()
    launch = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 models get float32 products
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x,
        w13,
        act,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        inter,
        hidden,
        top_k,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        **launch,
    )
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        act,
        w2,
        per_pair,
        weights,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        **launch,
    )
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
