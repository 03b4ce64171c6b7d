"""The FP8 CUDA kernels, in Triton (imports ``triton``: import it lazily): activation quantization, the
block-scaled W8A8 GEMM, and the few-row weight-only (W8A16) GEMM of a decode step.

Each computes what its counterpart in :mod:`nanovllm_quant_fp8.fp8` computes (that module is the contract):

- :func:`quantize_activation`: ``fp8.quantize_activation`` bit for bit (the scale and the e4m3 bytes), in one
  launch;
- :func:`w8a8_block_matmul`: the product of an activation quantized per ``1 x BK`` group and a weight scaled per
  ``BN x BK`` tile, on FP8 tensor cores, accumulated in float32 (``fp8.w8a8_reference`` up to the order of the
  float32 sums);
- :func:`w8a16_linear`: ``x`` as it is times the FP8 weight dequantized on the fly (``fp8.w8a16_reference`` up to
  the order of the sums), for a decode step's few rows: such a step is a stream of weight reads, and an FP8
  weight is half the bytes of a 16-bit one. It may apply the SiLU-and-mul after a ``[gate; up]`` product, and
  :func:`w8a16_norm_linear` the residual add and RMSNorm before the product, in the same launch.

As in the core's kernels (``nanovllm_core.layers.skinny_gemm_kernel``), the bodies are plain functions wrapped on
first use as a compiled ``JITFunction`` (CUDA tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's
interpreter, for tests), and take the ``PDL`` flag of ``nanovllm_core.layers.triton_jit``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

from .fp8 import FP8_DTYPE

# Rows :func:`w8a16_linear` takes: a decode step's batch, where the weight's bytes set the step's time. With more
# rows the W8A8 GEMM's FP8 tensor cores (or a 16-bit GEMM) reuse each weight tile enough to win.
MAX_ROWS = 16

# Reductions by their combine functions: ``tl.max`` and ``tl.sum`` are themselves jitted functions, which
# Triton's interpreter cannot call from a kernel it did not rewrite
_max = tl.standard._elementwise_max
_sum = tl.standard._sum_combine
# 1 / 448 rounded to float32 (exactly 0x1.24924ap-9): PyTorch's CUDA division by a scalar multiplies by it
_INV_FP8_MAX = tl.constexpr(0.0022321429569274187)


# ----------------------------------------------------------------------------------------------------
# Activation quantization
# ----------------------------------------------------------------------------------------------------


def _quantize_kernel(
    X, XQ, S, M, K, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, PER_TOKEN: tl.constexpr,
    RECIPROCAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``(row, pid_g)``: quantize row ``row`` of ``X`` to e4m3 (``XQ``, a ``uint8`` view) with its scales
    ``S``, as ``fp8.quantize_activation`` does.

    ``PER_TOKEN``: one scale for the row (``S[row, 0]``); the program reads the row twice in ``BLOCK_C`` chunks,
    for its largest magnitude, then to quantize (the second read hits the cache). Otherwise the program owns
    ``BLOCK_G`` groups of ``GROUP`` columns (``BLOCK_C`` is ``GROUP`` rounded up to a power of two), a
    ``[BLOCK_G, BLOCK_C]`` tile read once; the last group may be cut short by ``K``.

    ``scale = max(amax / 448, 1e-12)`` is rounded as PyTorch rounds it on the tensors' device: an IEEE division
    on the CPU, a product with ``1 / 448`` (rounded to float32) on CUDA (``RECIPROCAL``), where PyTorch divides by
    a scalar so; ``x / scale`` is an IEEE division (``div_rn``) on both. The quotient is rounded to the e4m3 grid
    in float32 (ties to even) and its byte assembled from the bits. No float-to-e4m3 conversion: Triton's
    interpreter loses a rounding's carry into the exponent, and the GPU writes a negative value that rounds to
    zero as +0 where PyTorch writes -0.
    """
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_C)
    x_row = X + row * stride_x
    q_row = XQ + row * stride_q
    first = tl.program_id(1) * (BLOCK_G * GROUP)  # the first column this program owns
    in_group = (j < GROUP)[None, :]
    if PER_TOKEN:
        amax = tl.full([BLOCK_G, BLOCK_C], 0.0, dtype=tl.float32)
        for k in range(0, K, BLOCK_C):
            cols = k + g[:, None] * GROUP + j[None, :]
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        row_amax = tl.reduce(tl.reduce(amax, 1, _max), 0, _max)
        if RECIPROCAL:
            row_scale = tl.maximum(row_amax * _INV_FP8_MAX, 1e-12)
        else:
            row_scale = tl.maximum(tl.div_rn(row_amax, 448.0), 1e-12)
        tl.store(S + row * stride_s, row_scale)
        stop = K
    else:
        stop = 1
    for k in range(0, stop, BLOCK_C):
        cols = first + k + g[:, None] * GROUP + j[None, :]
        ok = in_group & (cols < K)
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if PER_TOKEN:
            scale = row_scale
        else:
            group_amax = tl.reduce(tl.abs(x), 1, _max)
            if RECIPROCAL:
                group_scale = tl.maximum(group_amax * _INV_FP8_MAX, 1e-12)
            else:
                group_scale = tl.maximum(tl.div_rn(group_amax, 448.0), 1e-12)
            groups = tl.program_id(1) * BLOCK_G + g
            tl.store(S + row * stride_s + groups, group_scale, mask=groups * GROUP < K)
            scale = group_scale[:, None]
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        # The grid step of e4m3 at |y|: 2**(e - 3) for |y| in [2**e, 2**(e + 1)), e >= -6, and the subnormals'
        # 2**-9 below 2**-6; as float32 biased exponents, max(e + 127, 121) - 3.
        step_exp = tl.maximum((bits >> 23) & 0xFF, 121) - 3
        step = (step_exp << 23).to(tl.float32, bitcast=True)
        inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
        # |y| / step < 16: adding and taking away 1.5 * 2**23 rounds it to an integer, ties to even
        magnitude = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
        mag_bits = magnitude.to(tl.int32, bitcast=True)
        exponent = (mag_bits >> 23) - 120  # e4m3's biased exponent (bias 7 against float32's 127)
        code = tl.where(exponent > 0, (exponent << 3) | ((mag_bits >> 20) & 7), (magnitude * 512.0).to(tl.int32))
        code = tl.where(y != y, 0x7F, code) | tl.where(bits < 0, 0x80, 0)  # NaN stays NaN; the sign, -0 included
        tl.store(q_row + cols, code.to(tl.uint8), mask=ok)


def quantize_activation(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_activation(x, group_size)`` in one launch: ``(xq, scale)``, ``xq`` contiguous e4m3 of ``x``'s
    shape, ``scale`` float32 ``[M, 1]`` (per token, ``group_size`` None) or ``[M, ceil(K / group_size)]`` (per
    ``1 x group_size`` group; ``K`` need not be a multiple), ``M`` the rows of ``x`` flattened to 2-D (``scale``
    keeps ``x``'s leading shape). ``x``: float32, bfloat16 or float16 with a contiguous last dimension.
    CUDA tensors run the compiled kernel; anything else runs it in Triton's interpreter (slow: tests only)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_activation takes float32, bfloat16 or float16, got {x.dtype}")
    if group_size is not None and group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    k = x.size(-1)
    rows = x.reshape(-1, k) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.size(0)
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    groups = 1 if group_size is None else -(-k // group_size)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and k:
        if group_size is None:
            block_c = min(triton.next_power_of_2(k), 4096)
            cfg = {"GROUP": block_c, "BLOCK_G": 1, "BLOCK_C": block_c, "PER_TOKEN": True}
            grid = (m, 1)
        else:
            block_c = triton.next_power_of_2(group_size)
            block_g = max(1, min(triton.next_power_of_2(groups), 2048 // block_c))
            cfg = {"GROUP": group_size, "BLOCK_G": block_g, "BLOCK_C": block_c, "PER_TOKEN": False}
            grid = (m, triton.cdiv(groups, block_g))
        num_warps = 4 if cfg["BLOCK_G"] * block_c >= 1024 else 1
        if group_size is None and block_c >= 2048:  # one program a row: its warps, not the rows, set the pace
            num_warps = 8
        _quantize(x.device.type != "cuda")[grid](
            rows, xq.view(torch.uint8), scale, m, k, rows.stride(0), xq.stride(0), scale.stride(0),
            RECIPROCAL=x.device.type == "cuda", **cfg, num_warps=num_warps, **launch_options(x),
        )  # fmt: skip
    return xq.view(x.shape), scale.view(*x.shape[:-1], groups)


@lru_cache(maxsize=2)
def _quantize(interpret: bool) -> object:
    return wrap_kernel(_quantize_kernel, interpret)


# ----------------------------------------------------------------------------------------------------
# W8A8: block-scaled FP8 GEMM
# ----------------------------------------------------------------------------------------------------


def _w8a8_block_kernel(
    A, B, C, AS, BS, BIAS, M, N, K, stride_am, stride_bn, stride_cm, stride_as, stride_bsn, stride_bsk,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C = (A * AS) @ (B * BS).T``: ``A`` e4m3 ``[M, K]`` with a float32
    scale per row and ``SCALE_K`` columns (``AS``), ``B`` e4m3 ``[N, K]`` with one per ``SCALE_N x SCALE_K`` tile
    (``BS``). ``BLOCK_K`` divides ``SCALE_K``, so every ``BLOCK_K`` step has one scale per row of ``A`` and one
    per column of ``C``: the step's e4m3 product (tensor cores, float32) is scaled by both and added up in
    float32. ``BIAS`` is added in float32 before the rounding to ``C``'s dtype.

    ``SWAP_AB`` (a decode batch's few rows): the program computes the tile's transpose, ``B @ A.T``. Hopper's
    e4m3 ``wgmma`` takes 64 rows a warp group but as few as 8 columns, and Triton multiplies a tile of fewer
    than 64 rows with the older ``mma`` after converting e4m3 to float16; swapped, the weight's columns fill the
    64 rows and the few activation rows are the columns.

    Programs walk the tiles ``GROUP_M`` tile rows at a time, column by column, so that the weight tiles a group
    reads stay in L2 for the group's other rows. Rows and columns past ``M`` and ``N`` are read wrapped around
    (in bounds, never stored) instead of masked, which keeps the loads unmasked unless ``K`` is cut short."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # both operands K contiguous (e4m3 wgmma reads K-major tiles only)
    if SWAP_AB:
        a_ptrs = A + rows[None, :] * stride_am + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        b_ptrs = B + cols[:, None] * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.full([BLOCK_N, BLOCK_M], 0.0, dtype=tl.float32)
    else:
        a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        b_ptrs = B + cols[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    as_ptrs = AS + rows * stride_as
    bs_ptrs = BS + (cols // SCALE_N) * stride_bsn

    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            if SWAP_AB:
                a = tl.load(a_ptrs, mask=k_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        group = (k * BLOCK_K) // SCALE_K
        a_scale = tl.load(as_ptrs + group)
        b_scale = tl.load(bs_ptrs + group * stride_bsk)
        if SWAP_AB:
            acc += tl.dot(b, a) * b_scale[:, None] * a_scale[None, :]
        else:
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_dtype = C.dtype.element_ty
    if SWAP_AB:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols).to(tl.float32)[:, None]
        c_ptrs = C + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, acc.to(out_dtype), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols).to(tl.float32)[None, :]
        c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(out_dtype), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@lru_cache(maxsize=2)
def _w8a8_block(interpret: bool) -> object:
    return wrap_kernel(_w8a8_block_kernel, interpret)


def w8a8_block_config(m: int, n: int, k: int, block_k: int) -> dict[str, int]:
    """Tiles and warps of :func:`w8a8_block_matmul` for ``m`` rows of an ``[n, k]`` weight on Hopper: narrow
    tiles for a decode batch (the weight's bytes dominate, and enough programs must stream them), ``128 x 128``
    tiles for a prompt chunk (tensor-core bound). ``BLOCK_K`` is the weight's scale block ``block_k``, at most
    128 (the scales change every ``block_k`` columns; a larger power of two is split)."""
    step = min(block_k & -block_k, 128)  # the largest power of two dividing block_k
    if m <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP_AB": True, "num_warps": 4, "num_stages": 5}
    elif m <= 32:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "SWAP_AB": True, "num_warps": 4, "num_stages": 5}
    elif m <= 64:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    elif m <= 128:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}
    return {"SWAP_AB": False, **cfg, "BLOCK_K": step, "GROUP_M": 8}


def w8a8_block_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``(xq * x_scale) @ (wq * w_scale).T (+ bias)`` in ``out_dtype``, accumulated in float32.

    ``xq``: e4m3 ``[..., K]`` with a contiguous last dimension, and ``x_scale`` float32 ``[..., ceil(K / BK)]``
    (:func:`quantize_activation` with ``group_size = BK``); ``wq``: e4m3 ``[N, K]``, K contiguous; ``w_scale``:
    float32 ``[ceil(N / BN), ceil(K / BK)]`` for ``block = (BN, BK)``; ``bias``: ``[N]``, any float dtype.
    ``config`` overrides :func:`w8a8_block_config` (benchmarks sweep it). CUDA tensors run the compiled kernel;
    anything else runs it in Triton's interpreter (slow: tests only)."""
    bn, bk = block
    n, k = wq.shape
    if xq.dtype != FP8_DTYPE or wq.dtype != FP8_DTYPE:
        raise ValueError(f"w8a8_block_matmul takes {FP8_DTYPE} operands, got {xq.dtype} and {wq.dtype}")
    if xq.size(-1) != k:
        raise ValueError(f"xq has {xq.size(-1)} features, the weight takes {k}")
    groups = -(-k // bk)
    if w_scale.shape != (-(-n // bn), groups):
        raise ValueError(f"w_scale must be [{-(-n // bn)}, {groups}] for a [{n}, {k}] weight in {block} blocks, "
                         f"got {tuple(w_scale.shape)}")  # fmt: skip
    a = xq.reshape(-1, k)
    m = a.size(0)
    a_scale = x_scale.reshape(m, -1)
    if a_scale.size(1) != groups:
        raise ValueError(f"x_scale must have {groups} groups of {bk} columns a row, got {a_scale.size(1)}")
    if a.stride(-1) != 1:
        a = a.contiguous()
    if wq.stride(-1) != 1:
        raise ValueError("wq must have a contiguous last dimension")
    a_scale = a_scale.float()
    if a_scale.stride(-1) != 1:
        a_scale = a_scale.contiguous()
    b_scale = w_scale.float()
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m and n:
        cfg = dict(config or w8a8_block_config(m, n, k, bk))
        if bk % cfg["BLOCK_K"]:
            raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide the scale block {bk}")
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _w8a8_block(xq.device.type != "cuda")[grid](
            a, wq, out, a_scale, b_scale, out if bias is None else bias, m, n, k, a.stride(0), wq.stride(0),
            out.stride(0), a_scale.stride(0), b_scale.stride(0), b_scale.stride(1), SCALE_N=bn, SCALE_K=bk,
            EVEN_K=k % cfg["BLOCK_K"] == 0, HAS_BIAS=bias is not None, **cfg, **launch_options(xq),
        )  # fmt: skip
    return out.view(*xq.shape[:-1], n)


# ----------------------------------------------------------------------------------------------------
# W8A16: a decode step's few rows times an FP8 weight
# ----------------------------------------------------------------------------------------------------


def _w8a16_kernel(
    X, W, S, BIAS, Y, RES, NW, RES_OUT, M, N, K, stride_x, stride_r, stride_w, stride_y, stride_sn, stride_sk, eps,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCKWISE: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    LATE_SUM: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program ``pid``: ``Y[:M, cols] = X[:M] @ (W[cols] * S).T`` for the ``BLOCK_N`` columns ``cols`` it owns,
    reading its ``[BLOCK_N, K]`` slice of the e4m3 weight once, in ``BLOCK_K`` chunks.

    The weight converts exactly to ``X``'s 16-bit dtype (e4m3's values are all 16-bit values): with ``USE_DOT``
    each chunk is a tensor-core product in float32 (rows padded to ``M_PAD``, at least 16, in registers only);
    otherwise (a few rows) the products are summed on the CUDA cores in float32: each chunk's sums across the
    program's threads, or with ``LATE_SUM`` each thread's products added up elementwise over the chunks and summed
    across the threads once, at the end (no cross-thread reduction per chunk). ``BLOCKWISE``: ``S`` has one
    scale per ``SCALE_N x SCALE_K`` tile, and ``BLOCK_K`` divides ``SCALE_K``, so each chunk's sums are scaled as
    they are added; otherwise ``S`` has one scale per column, applied once to the finished sums.

    ``NORM``: the rows multiplied are ``NW * rms_norm(X [+ RES])``. Since every program reads the whole rows
    anyway, it sums their squares as it goes and multiplies each chunk by ``NW`` only (rounded to ``X``'s dtype);
    the rows' ``1 / rms`` scales the finished sums: the same product in exact arithmetic, one rounding of the
    normalised rows where the core's kernel has two, and no pass over the rows before the weight's.
    ``HAS_RESIDUAL``: the rows are ``X + RES`` rounded to ``X``'s dtype, which program 0 also writes to
    ``RES_OUT`` (contiguous).

    ``SILU_MUL``: ``W`` holds ``[gate; up]`` (``2N`` rows) and ``Y[:M, cols] = silu(gate) * up`` of the products
    ``X @ W[cols].T`` and ``X @ W[N + cols].T``, rounded as the separate product and the core's
    ``silu_and_mul`` kernel round (each product to ``Y``'s dtype, SiLU in float32 rounded again)."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # the last program's extra columns wrap around: read, never stored
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    offs_k = tl.arange(0, BLOCK_K)
    # x's chunk: a [M_PAD, BLOCK_K] tile; with LATE_SUM loaded broadcast along the weight's rows, as the weight's
    # tile is laid out, so that the loop converts no layout (repeats hit L1). The residual and the norm's weight
    # are loaded in the same layout (``row_tile``, ``k_tile``).
    if LATE_SUM and M_PAD == 1:  # [BLOCK_N, BLOCK_K]
        row_tile = 0
        k_tile = offs_k[None, :] + 0 * cols[:, None]
        x_rows_ok = tl.full([1, 1], 1, tl.int1)
    elif LATE_SUM:  # [M_PAD, BLOCK_N, BLOCK_K]
        row_tile = rows[:, None, None]
        k_tile = offs_k[None, None, :] + 0 * cols[None, :, None] + 0 * row_tile
        x_rows_ok = row_ok[:, None, None]
    else:
        row_tile = rows[:, None]
        k_tile = offs_k[None, :] + 0 * row_tile
        x_rows_ok = row_ok[:, None]
    x_ptrs = X + row_tile * stride_x + k_tile
    if USE_DOT:
        w_ptrs = W + cols[None, :] * stride_w + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K contiguous
    else:
        w_ptrs = W + cols[:, None] * stride_w + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N * stride_w  # SILU_MUL: the up projection's rows of the same columns
    s_ptrs = S + (cols // SCALE_N) * stride_sn
    s_up_ptrs = S + ((cols + N) // SCALE_N) * stride_sn
    dtype = X.dtype.element_ty
    acc = tl.full([M_PAD, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([M_PAD, BLOCK_N], 0.0, dtype=tl.float32)
    if LATE_SUM:
        wide = tl.full([BLOCK_N, BLOCK_K] if M_PAD == 1 else [M_PAD, BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)
        wide_up = tl.full([BLOCK_N, BLOCK_K] if M_PAD == 1 else [M_PAD, BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)
    squares = tl.full([M_PAD, BLOCK_K], 0.0, dtype=tl.float32)  # NORM: the rows' squares, once each
    plain = rows[:, None] * stride_x + offs_k[None, :]  # the rows' chunk without the broadcast: [M_PAD, BLOCK_K]
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        # LATE_SUM addresses each chunk of x from its start: a pointer tile carried through the loop in the weight's
        # layout costs a layout conversion (shared memory and barriers) every chunk
        x_chunk = x_ptrs + k * BLOCK_K if LATE_SUM else x_ptrs
        start = k * BLOCK_K
        if EVEN_K:
            x_ok = x_rows_ok
            plain_ok = row_ok[:, None]
            x = tl.load(x_chunk, mask=x_ok, other=0.0)
            w = tl.load(w_ptrs)
            if SILU_MUL:
                w_up = tl.load(up_ptrs)
        else:
            k_left = K - start
            k_ok = offs_k < k_left
            x_ok = x_rows_ok & (k_tile < k_left)
            plain_ok = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_chunk, mask=x_ok, other=0.0)
            w_ok = k_ok[:, None] if USE_DOT else k_ok[None, :]
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
            if SILU_MUL:
                w_up = tl.load(up_ptrs, mask=w_ok, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(RES + row_tile * stride_r + k_tile + start, mask=x_ok, other=0.0)
                 .to(tl.float32)).to(x.dtype)  # fmt: skip
            if pid == 0:  # the new residual (a broadcast tile stores each value several times: the same bytes)
                tl.store(RES_OUT + row_tile * K + k_tile + start, x, mask=x_ok)
        if NORM:
            if LATE_SUM:  # each row's values once, not once a weight row
                h = tl.load(X + plain + start, mask=plain_ok, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(RES + rows[:, None] * stride_r + offs_k[None, :] + start, mask=plain_ok, other=0.0)
                    h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
            else:
                h = x
            squares += h.to(tl.float32) * h.to(tl.float32)
            norm_weight = tl.load(NW + k_tile + start, mask=x_ok, other=0.0)
            x = (x.to(tl.float32) * norm_weight.to(tl.float32)).to(dtype)
        if LATE_SUM:
            if M_PAD == 1:
                part = w.to(tl.float32) * x.to(tl.float32)
                if SILU_MUL:
                    part_up = w_up.to(tl.float32) * x.to(tl.float32)
            else:
                part = x.to(tl.float32) * w.to(tl.float32)[None, :, :]
                if SILU_MUL:
                    part_up = x.to(tl.float32) * w_up.to(tl.float32)[None, :, :]
            if BLOCKWISE:
                group = (k * BLOCK_K) // SCALE_K
                chunk_scale = tl.load(s_ptrs + group * stride_sk)
                if M_PAD == 1:
                    wide += part * chunk_scale[:, None]
                else:
                    wide += part * chunk_scale[None, :, None]
                if SILU_MUL:
                    up_scale = tl.load(s_up_ptrs + group * stride_sk)
                    if M_PAD == 1:
                        wide_up += part_up * up_scale[:, None]
                    else:
                        wide_up += part_up * up_scale[None, :, None]
            else:
                wide += part
                if SILU_MUL:
                    wide_up += part_up
        else:
            if USE_DOT:
                part = tl.dot(x, w.to(dtype))
                if SILU_MUL:
                    part_up = tl.dot(x, w_up.to(dtype))
            else:
                part = tl.reduce(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2, _sum)
                if SILU_MUL:
                    part_up = tl.reduce(x.to(tl.float32)[:, None, :] * w_up.to(tl.float32)[None, :, :], 2, _sum)
            if BLOCKWISE:
                group = (k * BLOCK_K) // SCALE_K
                acc += part * tl.load(s_ptrs + group * stride_sk)[None, :]
                if SILU_MUL:
                    acc_up += part_up * tl.load(s_up_ptrs + group * stride_sk)[None, :]
            else:
                acc += part
                if SILU_MUL:
                    acc_up += part_up
        if not LATE_SUM:
            x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if LATE_SUM:
        acc = tl.reduce(wide, 1, _sum)[None, :] if M_PAD == 1 else tl.reduce(wide, 2, _sum)
        if SILU_MUL:
            acc_up = tl.reduce(wide_up, 1, _sum)[None, :] if M_PAD == 1 else tl.reduce(wide_up, 2, _sum)
    if not BLOCKWISE:
        acc *= tl.load(s_ptrs)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(s_up_ptrs)[None, :]
    if NORM:
        rstd = tl.rsqrt(tl.reduce(squares, 1, _sum) / K + eps)[:, None]
        acc *= rstd
        acc_up *= rstd
    if HAS_BIAS:
        acc += tl.load(BIAS + cols).to(tl.float32)[None, :]
    out_dtype = Y.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        acc = silu * acc_up.to(out_dtype).to(tl.float32)
    y_ptrs = Y + rows[:, None] * stride_y + offs_n[None, :]
    tl.store(y_ptrs, acc.to(out_dtype), mask=row_ok[:, None] & (offs_n < N)[None, :])


@lru_cache(maxsize=2)
def _w8a16(interpret: bool) -> object:
    return wrap_kernel(_w8a16_kernel, interpret)


def w8a16_config(
    m: int, n: int, k: int, block: tuple[int, int] | None, silu_mul: bool = False
) -> dict[str, int | bool]:
    """Launch of :func:`w8a16_linear` for ``m`` rows of an ``[n, k]`` weight: narrow column slices, so that a
    decode step's matrices spread over every SM; tensor cores from five rows on (the CUDA cores' float32
    products grow with the rows), and below that ``LATE_SUM`` (the sums across threads once, after the loop).
    With block scales ``BLOCK_K`` divides the scale block's ``BK``. ``silu_mul``: a program of the CUDA cores'
    path owns half the columns of each projection, so that it reads as many weight rows as without (not with
    block scales, whose short chunks already load a few bytes a thread)."""
    use_dot = m > 4
    one_row = m <= 1
    m_pad = max(triton.next_power_of_2(max(m, 1)), 16 if use_dot else 1)
    block_k = 256 if use_dot else 1024 if one_row else 512
    if block is not None:
        block_k = min(block_k, block[1] & -block[1])
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = 16 if use_dot else 4 if one_row else 8
    if silu_mul and block is None and not use_dot:
        block_n //= 2
    # one row: many small two-warp programs, each loading 16 bytes a thread of each weight row it owns per chunk
    # (the fastest on every projection of ``benchmarks/decode_gemm.py --shape qwen3-8b --rows 1 --fp8 --sweep``);
    # LATE_SUM: faster than the sums of every chunk on all but one projection of one row, at one to four rows
    return {"M_PAD": m_pad, "BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot, "LATE_SUM": not use_dot,
            "num_warps": 2 if one_row else 4, "num_stages": 4}  # fmt: skip


def supports(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether :func:`w8a16_linear` takes these: ``x`` bfloat16 or float16 of at most ``MAX_ROWS`` rows (any
    leading shape) with a contiguous last dimension, ``wq`` a 2-D e4m3 weight of ``x``'s width, rows contiguous."""
    return (
        x.dim() >= 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and wq.dtype == FP8_DTYPE
        and wq.dim() == 2
        and wq.stride(-1) == 1
        and wq.size(1) == x.size(-1)
        and x.numel() <= MAX_ROWS * x.size(-1)
    )


def w8a16_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    config: dict[str, int | bool] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ (wq * w_scale).T (+ bias)`` in ``x``'s dtype, accumulated in float32, for ``x`` of at most
    ``MAX_ROWS`` rows (any leading shape; :func:`supports` says what it takes).

    ``w_scale``: float32 ``[N]`` per output channel (``block`` None; ``[N, 1]`` too) or ``[ceil(N / BN),
    ceil(K / BK)]`` for ``block = (BN, BK)``; ``bias``: ``[N]``. ``silu_mul``: ``wq`` holds ``[gate; up]`` and
    the result is ``silu(gate) * up`` (``N / 2`` wide, no bias), as the core's ``silu_and_mul`` computes it from
    the full product, without writing that product. ``config`` overrides :func:`w8a16_config` (benchmarks sweep
    it; with block scales its ``BLOCK_K`` must divide ``BK``). CUDA tensors run the compiled kernel; anything else
    runs it in Triton's interpreter (slow: tests only)."""
    return _w8a16_launch(x, wq, w_scale, block, bias, config, silu_mul, None, 0.0, None)[0]


def w8a16_norm_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int] | None,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    config: dict[str, int | bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8a16_linear(h, wq, w_scale, block, silu_mul=silu_mul), x + residual)`` with ``h = norm_weight *
    rms_norm(x + residual)``, in one launch that never writes ``h``: the sum ``x + residual`` rounded to ``x``'s
    dtype as the core's kernels round it, the norm applied to the product's float32 sums (the kernel says how).
    Without ``residual`` the second result is ``x`` itself. ``residual``: ``x``'s shape and dtype, last dimension
    contiguous; ``norm_weight``: ``x``'s width, of its dtype, contiguous."""
    width = x.size(-1)
    if norm_weight.shape != (width,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"w8a16_norm_linear takes a contiguous norm_weight [{width}] of {x.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")  # fmt: skip
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"w8a16_norm_linear takes a residual of x's shape and dtype {tuple(x.shape)} {x.dtype} with "
                         f"a contiguous last dimension, got {tuple(residual.shape)} {residual.dtype} strides "
                         f"{residual.stride()}")  # fmt: skip
    y, residual_out = _w8a16_launch(x, wq, w_scale, block, None, config, silu_mul, norm_weight, eps, residual)
    return y, x if residual_out is None else residual_out.view(x.shape)


def _w8a16_launch(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    config: dict[str, int | bool] | None,
    silu_mul: bool,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The product and, with ``norm_weight`` and ``residual``, the new residual rows ``[m, K]``."""
    if not supports(x, wq):
        raise ValueError(
            f"w8a16_linear takes at most {MAX_ROWS} rows of bfloat16/float16 with a contiguous last dimension "
            f"and a 2-D {FP8_DTYPE} weight of their width; got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, "
            f"wq {tuple(wq.shape)} {wq.dtype}"
        )
    n, k = wq.shape
    if silu_mul and (n % 2 or bias is not None):
        raise ValueError(f"silu_mul takes a [gate; up] weight of an even number of rows and no bias, got {n} rows "
                         f"and {'a' if bias is not None else 'no'} bias")  # fmt: skip
    scale = w_scale.float()
    if block is None:
        if scale.numel() != n:
            raise ValueError(f"a per-channel w_scale must have {n} values, got {tuple(w_scale.shape)}")
        scale = scale.reshape(n, 1)
        scale_n, scale_k = 1, k
    else:
        scale_n, scale_k = block
        if scale.shape != (-(-n // scale_n), -(-k // scale_k)):
            raise ValueError(f"w_scale must be [{-(-n // scale_n)}, {-(-k // scale_k)}] for a [{n}, {k}] weight "
                             f"in {block} blocks, got {tuple(w_scale.shape)}")  # fmt: skip
    width = n // 2 if silu_mul else n
    rows = x.reshape(-1, k)
    m = rows.size(0)
    y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    norm = norm_weight is not None
    res = residual.reshape(-1, k) if norm and residual is not None else None
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if res is not None else None
    if m and width:
        cfg = {"LATE_SUM": False, **(config or w8a16_config(m, width, k, block, silu_mul))}
        if cfg["LATE_SUM"] and cfg["USE_DOT"]:
            raise ValueError("LATE_SUM sums the CUDA cores' products; it cannot go with USE_DOT")
        if block is not None and scale_k % cfg["BLOCK_K"]:
            raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide the scale block {scale_k}")
        _w8a16(x.device.type != "cuda")[(triton.cdiv(width, cfg["BLOCK_N"]),)](
            rows, wq, scale, y if bias is None else bias, y, rows if res is None else res,
            norm_weight if norm else rows, y if res_out is None else res_out,  # stand-ins for what a launch lacks
            m, width, k, rows.stride(0), 0 if res is None else res.stride(0), wq.stride(0), y.stride(0),
            scale.stride(0), scale.stride(1), eps, SCALE_N=scale_n, SCALE_K=scale_k, BLOCKWISE=block is not None,
            EVEN_K=k % cfg["BLOCK_K"] == 0, HAS_BIAS=bias is not None, NORM=norm, HAS_RESIDUAL=res is not None,
            SILU_MUL=silu_mul, **cfg, **launch_options(x),
        )  # fmt: skip
    return y.view(*x.shape[:-1], width), res_out
