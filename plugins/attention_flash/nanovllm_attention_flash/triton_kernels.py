"""The Triton kernels of the ``triton`` attention backend (this module imports ``triton``: import it lazily).

Layout of one layer's KV cache (the core's default, shared with the ``torch`` and ``flash_attn`` backends):
``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
with ``head_dim`` contiguous. Token ``j`` of sequence ``i`` lives in block ``block_tables[i, j // block_size]``
at row ``j % block_size``. An FP8 cache (``kv_cache_dtype = "fp8"``, ``fp8_cache``) has the same layout in e4m3
plus ``[num_blocks, num_kv_heads, block_size]`` float32 scales for keys and for values; the attention kernels
take those as ``key_scales``/``value_scales`` and dequantise on load.

Kernels (all of them take device tensors and never synchronise with the host):

- ``store_kv``: writes the step's new keys/values at ``slot_mapping`` (``-1`` = padding, skipped), into an FP8
  cache quantised with one scale per (token, KV head).
- ``decode_attention``: flash-decoding for sequences with exactly one query token. One program handles every
  query head of one KV head (GQA: each KV tile is read once for the whole group) over one split of a context;
  the batch's tiles are dealt into equal splits, so a long context gets more of them than a short one, and the
  last split of a sequence to finish merges them through their log-sum-exp. A sequence of one split is written
  directly.
- ``prefill_attention``: variable-length causal attention of the new tokens of each sequence against its whole
  context read from the paged cache (cached prefix + this chunk), causal with offset
  ``seq_len - query_len``: plain prefills, chunked prefills and prefix-cache hits take the same path. Its K/V
  tiles load through pointers, or through Hopper TMA descriptors with ``PrefillConfig.use_tma``.

Every kernel tile of ``BLOCK_N`` keys lies inside one cache block (``BLOCK_N`` divides ``block_size``; both are
powers of two), so a tile costs one block-table lookup and its rows are ``head_dim``-contiguous 16-byte loads.

Each kernel body is a plain function turned into a compiled ``JITFunction`` (CUDA tensors) or an
``InterpretedFunction`` (CPU tensors, Triton's interpreter) on first use, so CPU tests and GPU runs can share a
process without depending on ``TRITON_INTERPRET`` being set before import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import triton
import triton.language as tl

from nanovllm_core.layers import launch_options, wrap_kernel

# ----------------------------------------------------------------------------------------------------
# Kernel bodies
# ----------------------------------------------------------------------------------------------------


def _store_kv_kernel(
    K,
    V,
    KEY_CACHE,
    VALUE_CACHE,
    KEY_SCALES,
    VALUE_SCALES,
    SLOTS,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` key and value rows into the cache.

    ``KV_FP8``: quantise them to e4m3 instead, one scale per KV head (``fp8_cache``): ``scale = amax / 448``,
    ``value = rne(row / scale)``, both divisions IEEE-rounded (``div_rn``) as in PyTorch. The row is rounded to
    the e4m3 grid in float32 (the exponent picks the grid step: ``2**(e - 3)``, at least ``2**-9``, the subnormal
    step), then its e4m3 byte is assembled from the bits and stored through a byte view of the cache
    (``KEY_CACHE``/``VALUE_CACHE`` are ``uint8``): no float-to-fp8 conversion, whose rounding differs between
    Triton's interpreter (a carry into the exponent is lost) and the GPU (-0 becomes +0).
    """
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, DIM_P2)
    head_mask = offs_h < NUM_KV_HEADS
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = block * stride_c_block + row * stride_c_tok + offs_h[:, None] * stride_c_head + offs_d[None, :]
    for which in tl.static_range(2):  # keys, then values
        if which == 0:
            src, cache, scales = K + token * stride_k_tok, KEY_CACHE, KEY_SCALES
            src += offs_h[:, None] * stride_k_head
        else:
            src, cache, scales = V + token * stride_v_tok, VALUE_CACHE, VALUE_SCALES
            src += offs_h[:, None] * stride_v_head
        if KV_FP8:
            x = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = tl.div_rn(tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max), 448.0)
            y = tl.div_rn(x, tl.where(scale > 0.0, scale, 1.0)[:, None])
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            bits = y.to(tl.int32, bitcast=True)
            step_exp = tl.maximum((bits >> 23) & 0xFF, 121) - 3  # biased exponent of the grid step
            inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
            step = (step_exp << 23).to(tl.float32, bitcast=True)
            magnitude = tl.abs(((y * inv_step + 12582912.0) - 12582912.0) * step)  # 1.5 * 2**23: ties to even
            # The e4m3 byte is built from the rounded value's bits, not by a conversion: Hopper's float-to-e4m3
            # conversion writes a negative value rounded to zero as +0, a byte the reference quantization does not.
            mag_bits = magnitude.to(tl.int32, bitcast=True)
            exponent = (mag_bits >> 23) - 120  # e4m3's biased exponent (bias 7 against float32's 127)
            code = tl.where(exponent > 0, (exponent << 3) | ((mag_bits >> 20) & 7), (magnitude * 512.0).to(tl.int32))
            code = tl.where(magnitude != magnitude, 0x7F, code) | tl.where(bits < 0, 0x80, 0)  # NaN; the sign
            tl.store(cache + dst, code.to(tl.uint8), mask=mask)
            tl.store(scales + block * stride_s_block + offs_h * stride_s_head + row, scale, mask=head_mask)
        else:
            tl.store(cache + dst, tl.load(src + offs_d[None, :], mask=mask), mask=mask)


# int32 fields of a decode split-plan row (seven used; 32-byte rows); a constexpr, so the kernels can read it
PLAN_FIELDS = tl.constexpr(8)


def _decode_split_kernel(
    Q,
    KEY_CACHE,
    VALUE_CACHE,
    KEY_SCALES,
    VALUE_SCALES,
    BLOCK_TABLES,
    PLAN,
    OUT,
    PART_OUT,
    PART_LSE,
    COUNTERS,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_head,
    stride_bt,
    stride_o_tok,
    stride_o_head,
    stride_po_work,
    stride_po_head,
    stride_pl_work,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
    HALF_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (kv head, work item): attention of the ``GROUP`` query heads over one split of one context.

    The batch's decode work is dealt out by ``PLAN``, the step's split plan (:func:`split_plan`, computed once a
    step and read by every layer): row ``w`` names the sequence, its query token, its length, the KV tiles of
    split ``w``, and where that sequence's splits begin and how many there are; a row of ``seq == -1`` is past
    the batch's splits and its program exits.

    The KV head is the fastest grid axis, so the programs reading the ``num_kv_heads`` interleaved
    ``head_dim`` slices of the same cache rows run together (whole rows stream from DRAM). Sequences whose
    query length is not 1 get no split (the prefill kernel owns them); a padding row (``seq_len == 0``) gets
    one, which writes zeros.

    A sequence of one split writes ``OUT`` itself. Otherwise each split writes its normalised partial output to
    ``PART_OUT[w, head]`` and its base-2 log-sum-exp (of the scaled scores) to ``PART_LSE[w, head]``, then
    counts itself done in ``COUNTERS[seq, kv_head]``; the last split of the sequence to finish merges them all
    into ``OUT`` and resets the counter to 0 for the next launch (no second kernel).

    ``KV_FP8``: the cache holds e4m3 values with one float32 scale per (token, KV head) in ``KEY_SCALES`` /
    ``VALUE_SCALES`` (``[num_blocks, num_kv_heads, block_size]``, see ``fp8_cache``). Keys enter the dot as
    they are (e4m3 values are exact in 16 bits) and their scales multiply the scores; value tiles are
    dequantised before theirs.

    ``HALF_DOTS`` (an FP8 cache and a 16-bit ``Q``): both dots run in float16, which e4m3 converts to in one
    instruction for two values. Going to bfloat16 takes two or three more conversions a value, and those, not
    the cache's bytes, set the kernel's pace. ``Q`` is clamped to float16's range. The value scales multiply the
    probabilities (a ``[heads, keys]`` tile) instead of the ``[keys, head_dim]`` values, times 256 so that small
    products stay clear of float16's subnormals; the output divides the 256 out.
    """
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    kv_head = tl.program_id(0)
    work = tl.program_id(1)
    plan = PLAN + work * PLAN_FIELDS  # this work item's row of the step's split plan (_split_plan_kernel)
    seq = tl.load(plan)
    if seq < 0:
        return
    q_start = tl.load(plan + 1)
    seq_len = tl.load(plan + 2)
    tile_begin = tl.load(plan + 3)
    tile_end = tl.load(plan + 4)
    first_work = tl.load(plan + 5)
    num_splits = tl.load(plan + 6)

    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = Q + q_start.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)
    if HALF_DOTS:  # then k.to(q.dtype) below is float16 too
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM], 0.0, dtype=tl.float32)
    k_base = KEY_CACHE + kv_head * stride_c_head
    v_base = VALUE_CACHE + kv_head * stride_c_head
    ks_base = KEY_SCALES + kv_head * stride_s_head
    vs_base = VALUE_SCALES + kv_head * stride_s_head
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    # each tile's block-table entry is loaded one tile ahead (as in the prefill kernel), so the K/V loads of a
    # tile never wait on a load issued in the same iteration; the index is clamped to the last key
    last_key = tl.maximum(seq_len - 1, 0)
    block_next = tl.load(table + tl.minimum(tile_begin * BLOCK_N, last_key) // BLOCK_SIZE)
    for tile in range(tile_begin, tile_end):
        start = tile * BLOCK_N
        block = block_next.to(tl.int64)
        block_next = tl.load(table + tl.minimum(start + BLOCK_N, last_key) // BLOCK_SIZE)
        rows = (start % BLOCK_SIZE) + offs_n
        key_mask = (start + offs_n) < seq_len
        offsets = block * stride_c_block + rows[:, None] * stride_c_tok + offs_d[None, :]
        k = tl.load(k_base + offsets, mask=key_mask[:, None], other=0.0)
        if KV_FP8:
            k_scale = tl.load(ks_base + block * stride_s_block + rows, mask=key_mask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_base + offsets, mask=key_mask[:, None], other=0.0)
        if KV_FP8:
            v_scale = tl.load(vs_base + block * stride_s_block + rows, mask=key_mask, other=0.0)
            if HALF_DOTS:
                v = v.to(tl.float16)
                p = p * (v_scale * 256.0)[None, :]
            else:
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    norm = tl.where(has_keys, l_i, 1.0)
    if HALF_DOTS:
        norm = norm * 256.0
    out = acc / norm[:, None]
    o_ptrs = OUT + q_start.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    if num_splits == 1:
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=head_mask[:, None])
        return
    po_ptrs = PART_OUT + work.to(tl.int64) * stride_po_work + heads[:, None] * stride_po_head + offs_d[None, :]
    tl.store(po_ptrs, out, mask=head_mask[:, None])
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(PART_LSE + work.to(tl.int64) * stride_pl_work + heads, lse, mask=head_mask)
    # every thread's partial stores come before the count (the atomic releases them to the merging program,
    # whose acquire makes them visible; its loads skip L1, which may hold an earlier launch's partials)
    tl.debug_barrier()
    counter = COUNTERS + seq * tl.num_programs(0) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") != num_splits - 1:
        return
    tl.atomic_xchg(counter, 0)
    offs_w = tl.arange(0, MERGE_BLOCK)
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        m_all = tl.full([MERGE_BLOCK], float("-inf"), dtype=tl.float32)
        for w0 in range(first_work, first_work + num_splits, MERGE_BLOCK):
            w = w0 + offs_w
            lse_w = tl.load(PART_LSE + w.to(tl.int64) * stride_pl_work + head,
                            mask=w < first_work + num_splits, other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            m_all = tl.maximum(m_all, lse_w)
        m_max = tl.reduce(m_all, 0, tl.standard._elementwise_max)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.full([MERGE_BLOCK], 0.0, dtype=tl.float32)
        merged = tl.full([MERGE_BLOCK, HEAD_DIM], 0.0, dtype=tl.float32)
        for w0 in range(first_work, first_work + num_splits, MERGE_BLOCK):
            w = w0 + offs_w
            in_seq = w < first_work + num_splits
            lse_w = tl.load(PART_LSE + w.to(tl.int64) * stride_pl_work + head, mask=in_seq, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            weight = tl.exp2(lse_w - m_max)
            part = tl.load(PART_OUT + w.to(tl.int64)[:, None] * stride_po_work + head * stride_po_head
                           + offs_d[None, :], mask=in_seq[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
            total += weight
            merged += part * weight[:, None]
        denom = tl.reduce(total, 0, tl.standard._sum_combine)
        row = tl.reduce(merged, 0, tl.standard._sum_combine) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(OUT + q_start.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
                 row.to(OUT.dtype.element_ty))  # fmt: skip


def _split_plan_kernel(
    SEQ_LENS,
    QUERY_START_LOC,
    PLAN,
    num_seqs,
    target_splits,
    work_items,
    BLOCK_N: tl.constexpr,
    SEQS_P2: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``i < num_seqs``: the plan rows of sequence ``i``'s decode splits; program ``num_seqs``: marks
    the rows past the batch's splits (``seq = -1``).

    The batch's decode work is dealt out evenly: every split holds ``per_split`` tiles of ``BLOCK_N`` keys, with
    ``per_split = cdiv(total tiles, target_splits)``, so a sequence gets ``cdiv(its tiles, per_split)`` splits
    and a few long contexts among many short ones are cut as finely as the batch needs (with one split a
    sequence, the longest context alone would set the kernel's time). The splits of sequence ``i`` are the rows
    that follow those of the sequences before it; their count over the batch is at most ``target_splits +
    num_seqs = work_items``. Sequences whose query length is not 1 get no split (the prefill kernel owns them); a
    padding row (``seq_len == 0``) gets one, of no tiles, which writes zeros. Row fields: sequence, query token,
    ``seq_len``, first tile, end tile, first row of the sequence, its split count.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    offs_s = tl.arange(0, SEQS_P2)
    in_batch = offs_s < num_seqs
    starts = tl.load(QUERY_START_LOC + offs_s, mask=in_batch, other=0)
    ends = tl.load(QUERY_START_LOC + offs_s + 1, mask=in_batch, other=0)
    lens = tl.load(SEQ_LENS + offs_s, mask=in_batch, other=0)
    tiles = tl.where(in_batch & (ends - starts == 1), tl.maximum((lens + BLOCK_N - 1) // BLOCK_N, 1), 0)
    per_split = tl.maximum((tl.reduce(tiles, 0, tl.standard._sum_combine) + target_splits - 1) // target_splits, 1)
    splits = (tiles + per_split - 1) // per_split
    offs_r = tl.arange(0, ROWS)
    if i == num_seqs:
        for r0 in range(tl.reduce(splits, 0, tl.standard._sum_combine), work_items, ROWS):
            r = r0 + offs_r
            tl.store(PLAN + r * PLAN_FIELDS, tl.full([ROWS], -1, tl.int32), mask=r < work_items)
        return
    split_ends = tl.associative_scan(splits, 0, tl.standard._sum_combine)
    mine = offs_s == i
    num_splits = tl.reduce(tl.where(mine, splits, 0), 0, tl.standard._sum_combine)
    first = tl.reduce(tl.where(mine, split_ends, 0), 0, tl.standard._sum_combine) - num_splits
    seq_len = tl.load(SEQ_LENS + i)
    q_start = tl.load(QUERY_START_LOC + i)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    zeros = tl.full([ROWS], 0, tl.int32)
    for r0 in range(0, num_splits, ROWS):
        j = r0 + offs_r
        in_seq = j < num_splits
        row = PLAN + (first + j) * PLAN_FIELDS
        tl.store(row, zeros + i, mask=in_seq)
        tl.store(row + 1, zeros + q_start, mask=in_seq)
        tl.store(row + 2, zeros + seq_len, mask=in_seq)
        tl.store(row + 3, j * per_split, mask=in_seq)
        tl.store(row + 4, tl.minimum(j * per_split + per_split, num_tiles), mask=in_seq)
        tl.store(row + 5, zeros + first, mask=in_seq)
        tl.store(row + 6, zeros + num_splits, mask=in_seq)


def _prefill_kernel(
    Q,
    KEY_CACHE,
    VALUE_CACHE,
    KEY_SCALES,
    VALUE_SCALES,
    BLOCK_TABLES,
    SEQ_LENS,
    QUERY_START_LOC,
    OUT,
    scale_log2,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_s_block,
    stride_s_head,
    stride_bt,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    USE_TMA: tl.constexpr,
    KV_FP8: tl.constexpr,
    HALF_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (query block, query head): ``BLOCK_M`` new tokens of one sequence against its paged context.

    Query blocks are numbered without a host-side table: sequence ``i``'s blocks start at
    ``query_start_loc[i] // BLOCK_M + i`` (strictly increasing in ``i``; the ranges are disjoint and their union
    fits in ``num_tokens // BLOCK_M + num_seqs``). A program finds its sequence by counting the sequences that
    start at or before its block (``SEQ_CHUNK`` of ``query_start_loc`` per vector load: one round trip for
    batches of up to ``SEQ_CHUNK`` sequences instead of a chain of ``log2(num_seqs)`` dependent loads); programs
    past a sequence's last block exit. Blocks are visited last-first so the longest (causal) ones start first.
    Row ``r`` of the chunk sits at context position ``seq_len - query_len + r`` and sees keys up to it: keys
    before the block's first position are unmasked; the diagonal tiles are masked. ``SKIP_SINGLE`` leaves
    sequences with one query token to the decode kernel.

    Scores stay unscaled: the running max is kept in base-2 units (``rowmax(s) * scale_log2``) and
    ``p = exp2(s * scale_log2 - m)`` is one FMA per score. Each tile's block-table entry is loaded one tile
    ahead into a register (a plain load, carried to the next iteration), so the K/V address of a tile never
    waits on a load issued in the same iteration: the compiler's software pipeline keeps its K/V copies in
    flight instead of draining them to fetch the table entry.

    ``USE_TMA``: ``KEY_CACHE``/``VALUE_CACHE`` are tensor descriptors over the cache viewed as
    ``[num_blocks * block_size, num_kv_heads * head_dim]`` with ``[BLOCK_N, HEAD_DIM]`` boxes (Hopper TMA);
    a tile is the box at row ``block * BLOCK_SIZE + start % BLOCK_SIZE``, column ``kv_head * HEAD_DIM``.
    Otherwise they are pointers and tiles are gathered with 16-byte loads.

    ``KV_FP8``: e4m3 values with per-(token, KV head) scales in ``KEY_SCALES``/``VALUE_SCALES``, applied as in
    the decode kernel (key scales on the scores, value tiles dequantised before the dot; ``HALF_DOTS``: float16
    dots, the value scales on the probabilities, as there).
    """
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # one flat grid axis: heads vary fastest (the group's programs read the same K/V tiles together),
    # query blocks last-first
    head = tl.program_id(0) % NUM_HEADS
    pid = tl.num_programs(0) // NUM_HEADS - 1 - tl.program_id(0) // NUM_HEADS
    seq = pid * 0 - 1
    for chunk in range(0, num_seqs, SEQ_CHUNK):
        offs_s = chunk + tl.arange(0, SEQ_CHUNK)
        in_batch = offs_s < num_seqs
        first_blocks = tl.load(QUERY_START_LOC + offs_s, mask=in_batch, other=0) // BLOCK_M + offs_s
        seq += tl.reduce(((first_blocks <= pid) & in_batch).to(tl.int32), 0, tl.standard._sum_combine)
    q_start = tl.load(QUERY_START_LOC + seq)
    q_len = tl.load(QUERY_START_LOC + seq + 1) - q_start
    seq_len = tl.load(SEQ_LENS + seq)
    m_block = pid - (q_start // BLOCK_M + seq)
    if m_block * BLOCK_M >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return
    context = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + tokens[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    if HALF_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    if USE_TMA:
        col = kv_head * HEAD_DIM  # this KV head's column in the 2-D view
    else:
        # a tile is (one scalar tile offset) + (these fixed in-tile offsets)
        tile_offs = offs_n[:, None] * stride_c_tok + offs_d[None, :]
        k_base = KEY_CACHE + kv_head * stride_c_head
        v_base = VALUE_CACHE + kv_head * stride_c_head
    ks_base = KEY_SCALES + kv_head * stride_s_head
    vs_base = VALUE_SCALES + kv_head * stride_s_head
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    block_next = tl.load(table)  # the first tile's block (every sequence here has a key)

    unmasked_end = ((context + m_block * BLOCK_M) // BLOCK_N) * BLOCK_N
    for diagonal in tl.static_range(2):
        if diagonal:
            # the diagonal: causal mask and the end of the context. Row r sees keys <= min(its position,
            # seq_len - 1) (rows past the chunk's end see the whole context, so no row is ever empty)
            begin = unmasked_end
            end = tl.minimum(context + (m_block + 1) * BLOCK_M, seq_len)
            last_key = tl.minimum(context + offs_m, seq_len - 1)
        else:
            # keys every row of the block sees: [0, context + first row), whole tiles only
            begin = 0
            end = unmasked_end
        for start in range(begin, end, BLOCK_N):
            block = block_next
            if diagonal:
                block_next = tl.load(table + tl.minimum(start + BLOCK_N, seq_len - 1) // BLOCK_SIZE)
            else:
                # the next tile (here or the diagonal's first) starts at or before the block's first row: a key
                block_next = tl.load(table + (start + BLOCK_N) // BLOCK_SIZE)
            # on the diagonal, keys past seq_len are read but never used: K's scores (and, FP8, the product with
            # the scales, which may be anything there too) are masked out; V's rows are zeroed (p is 0 there, but
            # the slots may hold NaN/Inf and 0 * NaN is NaN)
            keys = start + offs_n
            if USE_TMA:
                row = block * BLOCK_SIZE + start % BLOCK_SIZE
                k = KEY_CACHE.load([row, col])
            else:
                tile = block.to(tl.int64) * stride_c_block + (start % BLOCK_SIZE) * stride_c_tok
                k = tl.load(k_base + tile + tile_offs)
            if KV_FP8:
                scale_offs = block.to(tl.int64) * stride_s_block + start % BLOCK_SIZE + offs_n
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                s = s * tl.load(ks_base + scale_offs)[None, :]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if diagonal:
                s = tl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max) * scale_log2)
            p = tl.exp2(tl.fma(s, scale_log2, -m_new[:, None]))
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if USE_TMA:
                v = VALUE_CACHE.load([row, col])
            elif diagonal:
                v = tl.load(v_base + tile + tile_offs, mask=(keys < seq_len)[:, None], other=0.0)
            else:
                v = tl.load(v_base + tile + tile_offs)
            if KV_FP8:
                if diagonal:
                    v_scale = tl.load(vs_base + scale_offs, mask=keys < seq_len, other=0.0)
                else:
                    v_scale = tl.load(vs_base + scale_offs)
                if HALF_DOTS:
                    v = v.to(tl.float16)
                    p = p * (v_scale * 256.0)[None, :]
                else:
                    v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            if USE_TMA:
                if diagonal:  # after the dequantisation: NaN * 0 is NaN
                    v = tl.where((keys < seq_len)[:, None], v, 0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    norm = tl.where(l_i > 0.0, l_i, 1.0)
    if HALF_DOTS:
        norm = norm * 256.0
    out = acc * (1.0 / norm)[:, None]
    o_ptrs = OUT + tokens[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_mask[:, None])


# ----------------------------------------------------------------------------------------------------
# Compiled / interpreted variants
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _KernelSet:
    store_kv: object
    split_plan: object
    decode_split: object
    prefill: object


@lru_cache(maxsize=2)
def _kernel_set(interpret: bool) -> _KernelSet:
    wrap = partial(wrap_kernel, interpret=interpret)
    # batch-dependent integers (counts, the block table's width) are not specialised: a value of 1 or a
    # multiple of 16 would compile a variant (and `TritonAttentionBackend.warmup` could not foresee it)
    return _KernelSet(
        store_kv=wrap(_store_kv_kernel),
        split_plan=wrap(_split_plan_kernel, do_not_specialize=["num_seqs", "target_splits", "work_items"]),
        decode_split=wrap(_decode_split_kernel, do_not_specialize=["stride_bt"]),
        prefill=wrap(_prefill_kernel, do_not_specialize=["num_seqs", "stride_bt"]),
    )


def _kernels_for(device: torch.device) -> _KernelSet:
    """Compiled kernels for CUDA tensors, Triton's interpreter for anything else (CPU tests)."""
    return _kernel_set(device.type != "cuda")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _half_dots(q: torch.Tensor, key_scales: torch.Tensor | None) -> bool:
    """The kernels' ``HALF_DOTS``: an FP8 cache and a 16-bit model (a float32 one keeps float32 dots)."""
    return key_scales is not None and q.dtype in (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Tile of the decode kernel: ``block_n`` keys per iteration (divides the cache block size)."""

    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of the prefill kernel: ``block_m`` queries x ``block_n`` keys (``block_n`` divides the block size).

    ``use_tma``: load K/V tiles through TMA tensor descriptors where the device has TMA (compute capability 9.0
    or newer; Triton's interpreter emulates it) and the cache's layout allows the 2-D view (see
    ``kv_tensor_descriptors``); elsewhere the pointer path runs.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False


def default_decode_config(head_dim: int, block_size: int, fp8: bool = False, group: int = 1) -> DecodeConfig:
    """64-key tiles (32 for head_dim 256), 4 warps, a 3-deep load pipeline (2 for head_dim 256).

    On an FP8 cache with head_dim <= 128 and up to 16 query heads a KV head (the query tile stays 16 rows):
    32-key tiles, one warp a program. One-warp programs keep more loads in flight an SM (only a few four-warp
    programs fit one), so the FP8 cache's halved bytes turn into time saved; chosen by timing both on uniform and
    ragged contexts with two and four query heads a KV head (the 0.6B's and the 8B's), which is all this default
    has been checked on (``bench_kernels.py --sweep decode`` in this plugin repeats the comparison).
    """
    if fp8 and head_dim <= 128 and group <= 16:
        return DecodeConfig(block_n=min(32, block_size), num_warps=1, num_stages=3)
    block_n = 32 if head_dim > 128 else 64
    return DecodeConfig(block_n=min(block_n, block_size), num_warps=4, num_stages=2 if head_dim > 128 else 3)


def default_prefill_config(
    head_dim: int, block_size: int, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> PrefillConfig:
    """128 x 64 tiles with 8 warps for head_dim <= 128; 64 x 32 with 4 warps for head_dim 256.

    On Hopper-class GPUs (TMA) with 16-bit head_dim 128 caches: 64 x 64 tiles, 4 warps, 3 stages, K/V through
    TMA, the fastest of a tile sweep (``bench_kernels.py --sweep prefill`` in this plugin) on Hopper.
    """
    tma_ok = device is not None and device.type == "cuda" and has_tma(device)
    if tma_ok and head_dim == 128 and dtype in (torch.float16, torch.bfloat16) and block_size >= 64:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, use_tma=True)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=min(32, block_size), num_warps=4, num_stages=2)
    return PrefillConfig(block_m=128, block_n=min(64, block_size), num_warps=8 if head_dim >= 128 else 4, num_stages=3)


MAX_KV_SPLITS = 64


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int, num_warps: int = 4
) -> int:
    """Number of KV splits for decode, from static values only (so a CUDA graph can capture it).

    The smallest power of two (at most ``MAX_KV_SPLITS``) that gives ``num_seqs * num_kv_heads * splits``
    programs of ``num_warps`` warps at least 16 warps an SM (4 programs of 4 warps, 16 of one), without more
    splits than ``max_context`` has tiles. One-warp programs of a batch with ragged contexts need the splits:
    without them the batch fits one wave and its longest sequence sets the time.
    ``max_context`` is the block-table capacity (``block_tables.shape[1] * block_size``), not a per-step length.
    """
    max_tiles = max(1, max_context // block_n)
    pairs = max(1, num_seqs * num_kv_heads)
    target = max(1, 16 // num_warps) * num_sms
    splits = 1
    while splits < MAX_KV_SPLITS and splits * 2 <= max_tiles and pairs * splits < target:
        splits *= 2
    return splits


@lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: interpreter runs)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _cache_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
    """Checks the cache; returns the kernels' scale arguments (for a 16-bit cache, placeholders that the kernels
    never read) and their stride arguments: the cache's block, row and head strides, the scales' block and head."""
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1, "the cache's head_dim must be contiguous"
    assert (key_scales is None) == (value_scales is None), "an FP8 cache needs key and value scales"
    if key_scales is None or value_scales is None:
        return (key_cache, key_cache), (*key_cache.stride()[:3], 0, 0)
    assert key_cache.dtype == torch.float8_e4m3fn, f"scales come with an e4m3 cache, not {key_cache.dtype}"
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    assert key_scales.shape == value_scales.shape == (num_blocks, num_kv_heads, block_size)
    assert key_scales.stride() == value_scales.stride() and key_scales.stride(-1) == 1
    return (key_scales, value_scales), (*key_cache.stride()[:3], *key_scales.stride()[:2])


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` (``[num_tokens, num_kv_heads, head_dim]``, last dim contiguous) into
    ``key_cache``/``value_cache`` (``[num_blocks, block_size, num_kv_heads, head_dim]``) at ``slot_mapping``
    (int64, ``block * block_size + row``; ``-1`` = padding, not stored). With ``key_scales``/``value_scales``
    (``[num_blocks, num_kv_heads, block_size]`` float32, ``fp8_cache.fp8_views``) the cache is e4m3 and each new
    row is quantised with its own scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    scales, strides = _cache_args(key_cache, value_cache, key_scales, value_scales)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    fp8 = key_scales is not None
    _kernels_for(k.device).store_kv[(num_tokens,)](
        k,
        v,
        key_cache.view(torch.uint8) if fp8 else key_cache,
        value_cache.view(torch.uint8) if fp8 else value_cache,
        *scales,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        KV_FP8=fp8,
        num_warps=4,
        **launch_options(k),
    )


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_seqs: int,
    num_splits: int,
    config: DecodeConfig,
    counters: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    plan: torch.Tensor | None = None,
) -> None:
    """Paged attention for the sequences of the batch that have exactly one query token.

    ``q``/``out``: ``[num_tokens, num_heads, head_dim]`` (head_dim contiguous); sequence ``i``'s token is
    ``query_start_loc[i]`` and its context the first ``seq_lens[i]`` cache slots of ``block_tables[i]``.
    Sequences with another query length are left untouched. ``num_splits``: KV splits a sequence on average
    (the batch's tiles are dealt into ``num_seqs * num_splits`` equal splits; a long context takes more, a short
    one fewer). The launch grid depends only on ``num_seqs``, the head counts and ``num_splits``, never on device
    data, so a CUDA graph can capture it; the split workspace has a static size too. ``counters``: int32 zeros,
    at least ``[num_seqs, num_kv_heads]``, left as zeros (:func:`split_counters`). ``key_scales``/
    ``value_scales``: the scales of an FP8 cache (``store_kv``). ``plan``: this step's :func:`split_plan` for
    ``config.block_n`` (made here when not given; every layer of a step can share one).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    if num_seqs == 0:
        return
    scales, strides = _cache_args(key_cache, value_cache, key_scales, value_scales)
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert block_size % config.block_n == 0, "decode tiles must not cross a cache block"
    assert counters.dtype == torch.int32 and counters.numel() >= num_seqs * num_kv_heads
    group = num_heads // num_kv_heads
    kernels = _kernels_for(q.device)
    if plan is None:
        plan = split_plan(seq_lens, query_start_loc, num_seqs, num_splits, config.block_n)
    work_items = plan.shape[0]
    part_out = torch.empty((work_items, num_heads, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((work_items, num_heads), dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))
    kernels.decode_split[(num_kv_heads, work_items)](
        q,
        key_cache,
        value_cache,
        *scales,
        block_tables,
        plan,
        out,
        part_out,
        part_lse,
        counters,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        *strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        MERGE_BLOCK=block_h,
        KV_FP8=key_scales is not None,
        HALF_DOTS=_half_dots(q, key_scales),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(q),
    )


def split_plan(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int, num_splits: int, block_n: int
) -> torch.Tensor:
    """The decode kernel's split plan for one step: ``[num_seqs * (num_splits + 1), PLAN_FIELDS]`` int32 rows
    (``_split_plan_kernel``), made on the device from the batch's lengths without a sync. Its size follows
    from ``num_seqs`` and ``num_splits`` alone (CUDA graphs); ``block_n`` is the decode tile's, which sets the
    tiles a split holds."""
    work_items = num_seqs * num_splits + num_seqs  # every split: each sequence's last one may be partly empty
    plan = torch.empty((work_items, PLAN_FIELDS.value), dtype=torch.int32, device=seq_lens.device)
    _kernels_for(seq_lens.device).split_plan[(num_seqs + 1,)](
        seq_lens,
        query_start_loc,
        plan,
        num_seqs,
        num_seqs * num_splits,
        work_items,
        BLOCK_N=block_n,
        SEQS_P2=seqs_bucket(num_seqs),
        ROWS=32,
        num_warps=4,
        **launch_options(seq_lens),
    )
    return plan


SEQS_BUCKETS = (64, 256, 1024)  # batch sizes the split plan is compiled for (its vector's length)


def seqs_bucket(num_seqs: int) -> int:
    """The split plan's ``SEQS_P2``: the smallest of ``SEQS_BUCKETS`` holding ``num_seqs`` rows (a power of two
    beyond), so that a few compiled variants serve every batch size."""
    return next((b for b in SEQS_BUCKETS if b >= num_seqs), triton.next_power_of_2(num_seqs))


def split_counters(rows: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed per-(sequence, KV head) counters for :func:`decode_attention`, which leaves them zero again."""
    return torch.zeros((rows, num_kv_heads), dtype=torch.int32, device=device)


@lru_cache(maxsize=16)
def has_tma(device: torch.device) -> bool:
    """Whether ``device`` can load through TMA descriptors: an NVIDIA GPU of compute capability 9.0 or newer, or
    Triton's interpreter (any device type but ``cuda``)."""
    if device.type != "cuda":
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def kv_tensor_descriptors(key_cache: torch.Tensor, value_cache: torch.Tensor, block_n: int) -> tuple | None:
    """TMA descriptors for the prefill kernel, or ``None`` where the pointer path must run instead.

    Each cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` is viewed as the 2-D tensor
    ``[num_blocks * block_size, num_kv_heads * head_dim]`` (row ``block * block_size + offset``, column
    ``kv_head * head_dim``) with ``[block_n, head_dim]`` boxes; that needs whole blocks and heads to be packed
    (``stride(0) == block_size * stride(1)``, ``stride(2) == head_dim``), 16-byte aligned rows and bases, and
    row indices that fit in int32.
    """
    if not has_tma(key_cache.device):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton
        return None
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    row_stride = key_cache.stride(1)
    itemsize = key_cache.element_size()
    if (
        key_cache.stride(0) != block_size * row_stride
        or key_cache.stride(2) != head_dim
        or (row_stride * itemsize) % 16
        or key_cache.data_ptr() % 16
        or value_cache.data_ptr() % 16
        or num_blocks * block_size >= 2**31
    ):
        return None
    shape = [num_blocks * block_size, num_kv_heads * head_dim]
    strides = [row_stride, 1]
    box = [block_n, head_dim]
    return TensorDescriptor(key_cache, shape, strides, box), TensorDescriptor(value_cache, shape, strides, box)


# query_start_loc entries a prefill program reads per vector load to find its sequence
PREFILL_SEQ_CHUNK = 256


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_seqs: int,
    config: PrefillConfig,
    skip_single: bool = False,
    warmup: bool = False,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Causal paged attention of every sequence's new tokens (``query_start_loc``) against its context.

    The new tokens' keys/values must already be in the cache (``store_kv``). ``skip_single`` leaves the
    sequences with one query token untouched (the decode kernel handles them). ``warmup``: only compile the
    kernel for these arguments (Triton's ``warmup``; compiled kernels only), launching nothing.
    ``key_scales``/``value_scales``: the scales of an FP8 cache (``store_kv``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    if num_seqs == 0 or num_tokens == 0:
        return
    scales, strides = _cache_args(key_cache, value_cache, key_scales, value_scales)
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert block_size % config.block_n == 0, "prefill key tiles must not cross a cache block"
    kernels = _kernels_for(q.device)
    descriptors = kv_tensor_descriptors(key_cache, value_cache, config.block_n) if config.use_tma else None
    k_arg, v_arg = descriptors if descriptors is not None else (key_cache, value_cache)
    grid = (num_heads * (num_tokens // config.block_m + num_seqs),)
    launch = partial(kernels.prefill.warmup, grid=grid) if warmup else kernels.prefill[grid]
    launch(
        q,
        k_arg,
        v_arg,
        *scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * math.log2(math.e),
        num_seqs,
        q.stride(0),
        q.stride(1),
        *strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        SEQ_CHUNK=PREFILL_SEQ_CHUNK,
        SKIP_SINGLE=skip_single,
        USE_TMA=descriptors is not None,
        KV_FP8=key_scales is not None,
        HALF_DOTS=_half_dots(q, key_scales),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(q),
    )
