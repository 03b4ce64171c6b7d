"""Per-head q/k RMSNorm and rotary embedding of one attention layer in one Triton kernel.

Qwen3 normalises every q and k head (RMSNorm over ``head_dim``) and then rotates them. Done with
:func:`~nanovllm_core.layers.fused.rms_norm` and :func:`~nanovllm_core.layers.fused.apply_rotary`, that is four
small kernels per layer (two norms, two rotations); in a decode step inside a CUDA graph their fixed costs add up
to a noticeable share of the step. This kernel reads q and k once, straight from the qkv GEMM output through
their strides, and writes the rotated heads once. Without norm weights (Qwen2) it applies the rotation only.

The arithmetic follows the torch path operation by operation: the norm in float32, rounded to the input dtype,
times the weight (rounded again); the rotation in float32 on that value, rounded to the input dtype; dims past
``rotary_dim`` pass through.

Grid: (token, head block). A program handles ``BLOCK_H`` heads of one token, all from q or all from k: the
first ``cdiv(num_heads, BLOCK_H)`` blocks are q's, the rest k's. Each head is loaded as its two rotated halves
(and the untouched rest, if any), so no element is read twice.

The kernel body is a plain function, wrapped on first use as a compiled ``JITFunction`` (CUDA tensors) or an
``InterpretedFunction`` (anything else: Triton's interpreter, for CPU tests). ``triton`` is imported only then:
the core does not depend on it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from nanovllm_core.layers import launch_options

tl: Any = None  # triton.language, bound by _kernel() on first use; the kernel body resolves it at compile time

# elements of one program's [BLOCK_H, head_dim] tile: big enough to amortise a program, small enough to spread
# a decode batch of a few hundred tokens over all SMs
_MIN_TILE = 512
_MAX_TILE = 2048


def _qk_norm_rope_kernel(
    POSITIONS,
    Q,
    K,
    Q_OUT,
    K_OUT,
    Q_WEIGHT,
    K_WEIGHT,
    COS_SIN,
    eps,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_ko_tok,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    REST: tl.constexpr,
    REST_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, head block): norm and rotate ``BLOCK_H`` heads of q (first blocks) or k (the rest)."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    is_q = block < q_blocks
    num_heads = tl.where(is_q, NUM_HEADS, NUM_KV_HEADS)
    first_head = tl.where(is_q, block, block - q_blocks) * BLOCK_H
    if is_q:
        src = Q + token * stride_q_tok
        dst = Q_OUT + token * stride_qo_tok
        stride_head = stride_q_head
    else:
        src = K + token * stride_k_tok
        dst = K_OUT + token * stride_ko_tok
        stride_head = stride_k_head
    dtype = Q.dtype.element_ty

    heads = first_head + tl.arange(0, BLOCK_H)
    offs_half = tl.arange(0, HALF_P2)
    half_mask = (heads < num_heads)[:, None] & (offs_half < HALF)[None, :]
    src_1 = src + heads[:, None] * stride_head + offs_half[None, :]
    dst_1 = dst + heads[:, None] * HEAD_DIM + offs_half[None, :]
    x1 = tl.load(src_1, mask=half_mask, other=0.0)
    x2 = tl.load(src_1 + HALF, mask=half_mask, other=0.0)
    if REST > 0:
        offs_rest = tl.arange(0, REST_P2)
        rest_mask = (heads < num_heads)[:, None] & (offs_rest < REST)[None, :]
        rest_offs = heads[:, None] * stride_head + 2 * HALF + offs_rest[None, :]
        x_rest = tl.load(src + rest_offs, mask=rest_mask, other=0.0)

    if HAS_WEIGHT:
        if is_q:
            weight = Q_WEIGHT
        else:
            weight = K_WEIGHT
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        # tl.reduce, not tl.sum: tl.sum is a JITFunction, which Triton's interpreter cannot call from here
        sum_sq = tl.reduce(x1f * x1f, 1, tl.standard._sum_combine) + tl.reduce(x2f * x2f, 1, tl.standard._sum_combine)
        if REST > 0:
            x_restf = x_rest.to(tl.float32)
            sum_sq += tl.reduce(x_restf * x_restf, 1, tl.standard._sum_combine)
        rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        # rms_norm: (x * rstd) rounded to the dtype, then times the weight (a product rounded to the dtype)
        w1 = tl.load(weight + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight + HALF + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)
        x1 = ((x1f * rstd).to(dtype).to(tl.float32) * w1[None, :]).to(dtype)
        x2 = ((x2f * rstd).to(dtype).to(tl.float32) * w2[None, :]).to(dtype)
        if REST > 0:
            w_rest = tl.load(weight + 2 * HALF + offs_rest, mask=offs_rest < REST, other=0.0).to(tl.float32)
            x_rest = ((x_restf * rstd).to(dtype).to(tl.float32) * w_rest[None, :]).to(dtype)

    position = tl.load(POSITIONS + token).to(tl.int64)
    cos = tl.load(COS_SIN + position * stride_cs + offs_half, mask=offs_half < HALF).to(tl.float32)[None, :]
    sin = tl.load(COS_SIN + position * stride_cs + HALF + offs_half, mask=offs_half < HALF).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(dst_1, (x1f * cos - x2f * sin).to(dtype), mask=half_mask)
    tl.store(dst_1 + HALF, (x2f * cos + x1f * sin).to(dtype), mask=half_mask)
    if REST > 0:
        tl.store(dst + heads[:, None] * HEAD_DIM + 2 * HALF + offs_rest[None, :], x_rest, mask=rest_mask)


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    global tl
    import triton.language

    tl = triton.language
    from nanovllm_core.layers import wrap_kernel

    return wrap_kernel(_qk_norm_rope_kernel, interpret)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Heads per program: k's head count when that fills a useful tile (no idle rows in any block), else
    more (a few idle rows in k's blocks cost less than tiny programs), never more than ``_MAX_TILE`` elements."""
    dim = _next_power_of_2(head_dim)
    block_h = max(_next_power_of_2(min(num_heads, num_kv_heads)), _MIN_TILE // dim)
    return max(1, min(block_h, _next_power_of_2(max(num_heads, num_kv_heads)), _MAX_TILE // dim))


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` of every q and k head (skipped when the weights are None), then ``apply_rotary``.

    ``q``: [tokens, heads, head_dim], ``k``: [tokens, kv_heads, head_dim], each with ``head_dim`` contiguous
    (views into the qkv projection's output are read in place). ``cos_sin_cache``: [max_position, rotary_dim],
    ``cat(cos, sin)`` per position. Returns new contiguous tensors shaped like ``q`` and ``k``. CUDA tensors run
    the compiled kernel, anything else Triton's interpreter. Never synchronises with the host.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"shapes do not match: positions {positions.shape}, q {q.shape}, k {k.shape}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a contiguous last dimension")
    if k.dtype != q.dtype:
        raise ValueError(f"q and k differ in dtype: {q.dtype} and {k.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both norm weights or neither")
    if q_weight is not None and not (q_weight.dtype == k_weight.dtype == q.dtype):
        raise ValueError(f"norm weights must have the dtype of q ({q.dtype}), got {q_weight.dtype}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"bad rotary_dim {rotary_dim} for head_dim {head_dim}, cache {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache needs a contiguous last dimension")

    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    block_h = _block_heads(num_heads, num_kv_heads, head_dim)
    num_blocks = -(-num_heads // block_h) + -(-num_kv_heads // block_h)
    tile = block_h * _next_power_of_2(head_dim)
    has_weight = q_weight is not None
    _kernel(q.device.type != "cuda")[(num_tokens, num_blocks)](
        positions,
        q,
        k,
        q_out,
        k_out,
        q_weight if has_weight else q,  # unread without weights
        k_weight if has_weight else k,
        cos_sin_cache,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        k_out.stride(0),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=_next_power_of_2(half),
        REST=rest,
        REST_P2=_next_power_of_2(rest),
        BLOCK_H=block_h,
        HAS_WEIGHT=has_weight,
        num_warps=max(1, min(8, tile // 256)),
        **launch_options(q),
    )
    return q_out, k_out
