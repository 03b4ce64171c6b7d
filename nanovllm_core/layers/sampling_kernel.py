"""Temperature sampling in one Triton pass over the logits, with its noise drawn in-kernel (imports ``triton``:
import it lazily).

Each row draws ``argmax_j(logits[j] / T - log(E_j))`` with ``E_j ~ Exp(1)``, the exponential race that draws
from ``softmax(logits / T)`` exactly; rows with ``T == 0`` take the plain argmax. Reading the logits once and
making the noise from a counter-based generator (Philox) replaces a float32 ``[rows, vocab]`` noise tensor that
costs a write and a read of ~155 MB per step at 256 rows.

Layout of the work: the vocabulary is cut into tiles of ``block = 4 * QUARTER`` logits, each tile into four
contiguous sub-blocks of ``QUARTER``. Program ``(row, split)`` scans a contiguous run of tiles keeping, per lane,
the best score seen and its index, and reduces across lanes once at the end. Logit ``(4 * t + k) * QUARTER + i``
of a row takes output ``k`` of Philox for counter ``(t * QUARTER + i, row)``: one Philox call feeds four logits
(the kernel is bound by arithmetic, Philox and logs, rather than by memory). The noise of an element thus
depends on ``(seed, row, index, block)`` but not on the split. With one split the kernel writes the token
directly; with several each split writes its best ``(score, index)`` and a second tiny kernel picks the best
per row. Splitting keeps the SMs busy for small batches: one program per row would leave a single-row decode
step scanning ~150k logits on one SM. Ties go to the smallest index in both passes.

Like the Triton attention plugin, the kernel bodies are plain functions wrapped on first use as a compiled
``JITFunction`` (CUDA tensors) or an ``InterpretedFunction`` (CPU tensors, Triton's interpreter, for tests).
"""

from __future__ import annotations

import math
from functools import cache, lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

_INDEX_SENTINEL = tl.constexpr(2**31 - 1)
# -log2(u) is at least ~8.6e-8 for u <= 1 - 2**-24; a fast approximate log2 can still round it to 0 or below
_MIN_NEG_LOG2_U = tl.constexpr(8e-8)
_U_SCALE = tl.constexpr(2.0**-23)
_PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
_PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
_PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
_PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)


def _sample_kernel(
    LOGITS,
    TEMPERATURES,
    OUT,
    PART_VALUE,
    PART_INDEX,
    seed,
    vocab_size,
    stride_row,
    tiles_per_split,
    num_splits,
    QUARTER: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, split): best ``logits * log2(e) / T - log2(-log2 U)`` over the split's tiles.

    Base 2 drops constant terms only (``log E = log2(-log2 U) + log2(ln 2)``, times a positive factor), so the
    argmax is the exponential race's. ``U = (m + 0.5) / 2**23`` for the top 23 bits ``m`` of a Philox output
    lies in ``[2**-24, 1 - 2**-24]``: neither log is ever taken of 0 or 1. ``FAST_LOG2`` (CUDA only: the
    interpreter cannot run libdevice) takes the outer log with the hardware approximation.

    Uses builtins only (no ``@triton.jit`` library functions such as ``tl.randint4x`` or ``tl.max``, nor
    helpers), so that the same body runs in the interpreter without ``TRITON_INTERPRET`` set at import.
    """
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(TEMPERATURES + row)
    greedy = temperature == 0.0
    scale = tl.where(greedy, 1.0, 1.4426950408889634 / tl.where(greedy, 1.0, temperature))
    row_logits = LOGITS + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, QUARTER)
    key = seed.to(tl.uint32)
    best_value = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.full([QUARTER], 0, tl.int32)
    for step in range(0, tiles_per_split):
        tile = split * tiles_per_split + step
        # sub-block k of the tile holds logits (4 * tile + k) * QUARTER + lane; loaded first so that the loads
        # are in flight during the noise arithmetic
        index = tile * 4 * QUARTER + lanes
        x0 = tl.load(row_logits + index, mask=index < vocab_size, other=float("-inf"))
        x1 = tl.load(row_logits + index + QUARTER, mask=index + QUARTER < vocab_size, other=float("-inf"))
        x2 = tl.load(row_logits + index + 2 * QUARTER, mask=index + 2 * QUARTER < vocab_size, other=float("-inf"))
        x3 = tl.load(row_logits + index + 3 * QUARTER, mask=index + 3 * QUARTER < vocab_size, other=float("-inf"))
        if greedy:
            # E = 1 everywhere: the same noise for every logit leaves the argmax alone
            e0 = tl.full([QUARTER], 1.0, tl.float32)
            e1 = e0
            e2 = e0
            e3 = e0
        else:
            # Philox4x32-10 of counter (tile * QUARTER + lane, row, 0, 0) and key (seed, 0): the rounds of
            # tl.randint4x, written out because the interpreter cannot call that @triton.jit function
            r0 = (tile * QUARTER + lanes).to(tl.uint32)
            r2 = r0 * 0
            r1 = r2 + row.to(tl.uint32)
            r3 = r2
            k0 = key
            k1 = key * 0
            for _ in tl.static_range(10):
                prev_r0 = r0
                prev_r2 = r2
                r0 = tl.umulhi(prev_r2, _PHILOX_ROUND_B) ^ r1 ^ k0
                r2 = tl.umulhi(prev_r0, _PHILOX_ROUND_A) ^ r3 ^ k1
                r1 = prev_r2 * _PHILOX_ROUND_B
                r3 = prev_r0 * _PHILOX_ROUND_A
                k0 = k0 + _PHILOX_KEY_A
                k1 = k1 + _PHILOX_KEY_B
            # sub-block k takes Philox output k: E / ln 2 = -log2 U, U = (top 23 bits + 0.5) / 2**23. This log
            # must be accurate (the winning E is often tiny, U close to 1): tl.log2 is libdevice's, not lg2.approx
            e0 = tl.maximum(-tl.log2(((r0 >> 9).to(tl.float32) + 0.5) * _U_SCALE), _MIN_NEG_LOG2_U)
            e1 = tl.maximum(-tl.log2(((r1 >> 9).to(tl.float32) + 0.5) * _U_SCALE), _MIN_NEG_LOG2_U)
            e2 = tl.maximum(-tl.log2(((r2 >> 9).to(tl.float32) + 0.5) * _U_SCALE), _MIN_NEG_LOG2_U)
            e3 = tl.maximum(-tl.log2(((r3 >> 9).to(tl.float32) + 0.5) * _U_SCALE), _MIN_NEG_LOG2_U)
        logits = (x0, x1, x2, x3)
        exponentials = (e0, e1, e2, e3)
        # each lane sees increasing indices, so the strict > keeps the first of equal scores
        for k in tl.static_range(4):
            if FAST_LOG2:
                # an absolute error of ~2**-22 in a score is harmless, and lg2.approx is one instruction
                noise = libdevice.fast_log2f(exponentials[k])
            else:
                noise = tl.log2(exponentials[k])
            score = logits[k].to(tl.float32) * scale - noise
            better = score > best_value
            best_value = tl.where(better, score, best_value)
            best_index = tl.where(better, index + k * QUARTER, best_index)
    value = tl.reduce(best_value, 0, tl.standard._elementwise_max)
    # an all -inf row (or split) keeps the initial index 0: still a valid token
    index = tl.reduce(tl.where(best_value == value, best_index, _INDEX_SENTINEL), 0, tl.standard._elementwise_min)
    if ONE_SPLIT:
        tl.store(OUT + row, index.to(tl.int64))
    else:
        tl.store(PART_VALUE + row * num_splits + split, value)
        tl.store(PART_INDEX + row * num_splits + split, index)


def _merge_kernel(PART_VALUE, PART_INDEX, OUT, num_splits, SPLITS_P2: tl.constexpr, PDL: tl.constexpr):
    """Program per row: the splits' best score, ties to the smallest index."""
    if PDL:  # programmatic dependent launch: see nanovllm_core.layers.triton_jit
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_P2)
    mask = offs < num_splits
    values = tl.load(PART_VALUE + row * num_splits + offs, mask=mask, other=float("-inf"))
    indices = tl.load(PART_INDEX + row * num_splits + offs, mask=mask, other=_INDEX_SENTINEL)
    best = tl.reduce(values, 0, tl.standard._elementwise_max)
    index = tl.reduce(tl.where(values == best, indices, _INDEX_SENTINEL), 0, tl.standard._elementwise_min)
    tl.store(OUT + row, index.to(tl.int64))


@lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple:
    """The sampling and merge kernels, compiled (CUDA) or interpreted. The seed changes every launch and the
    split counts with the batch: no variant is compiled per value."""
    sample = wrap_kernel(_sample_kernel, interpret, do_not_specialize=["seed", "tiles_per_split", "num_splits"])
    return sample, wrap_kernel(_merge_kernel, interpret, do_not_specialize=["num_splits"])


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(rows: int, num_tiles: int, device: torch.device) -> int:
    """Splits per row for about four programs per SM: enough warps to hide the loads' latency behind the
    Philox arithmetic of others, while a split still scans whole tiles."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(num_tiles, math.ceil(4 * sms / rows)))


def sample_temperature(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed: int,
    *,
    block: int = 4096,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]``: a draw from ``softmax(logits / T)``, or the argmax
    where ``temperatures`` (float32 ``[rows]``, same device) is 0.

    ``seed`` (0 <= seed < 2**31) picks the noise: the same seed, logits, temperatures and ``block`` give the
    same tokens whatever ``num_splits`` (default: chosen from the SM count). CUDA tensors run the compiled kernel
    without synchronising with the host; CPU tensors run the same kernel in Triton's interpreter (slow: tests
    only). Returns int64 ``[rows]``.
    """
    assert logits.dim() == 2 and temperatures.shape == (logits.size(0),), "logits [rows, vocab], temps [rows]"
    assert block >= 4 and block & (block - 1) == 0, "block must be a power of two >= 4"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperatures = temperatures.to(torch.float32).contiguous()
    rows, vocab = logits.shape
    assert vocab > 0, "empty vocabulary"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_tiles = triton.cdiv(vocab, block)
    splits = num_splits if num_splits is not None else _default_splits(rows, num_tiles, logits.device)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(splits, num_tiles)))
    splits = triton.cdiv(num_tiles, tiles_per_split)
    sample, merge = _kernels(logits.device.type != "cuda")
    part_value = part_index = out  # unused with one split
    if splits > 1:
        part_value = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        part_index = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    options = launch_options(logits)
    sample[(rows, splits)](
        logits,
        temperatures,
        out,
        part_value,
        part_index,
        seed,
        vocab,
        logits.stride(0),
        tiles_per_split,
        splits,
        QUARTER=block // 4,
        ONE_SPLIT=splits == 1,
        FAST_LOG2=logits.is_cuda,
        num_warps=8 if block >= 4096 else 4,
        **options,
    )
    if splits > 1:
        merge[(rows,)](part_value, part_index, out, splits, SPLITS_P2=triton.next_power_of_2(splits), **options)
    return out


def warmup(logits: torch.Tensor, *, block: int = 4096) -> int:
    """Compile every variant ``sample_temperature`` can launch on logits like ``logits`` (``[rows, vocab]``, the
    model's: dtype and vocabulary matter): one split and each power-of-two bucket of split counts the merge kernel
    is specialised on (``SPLITS_P2``), which the default split count reaches as a batch's row count changes. A
    variant first met inside ``generate`` compiles there, in the middle of a step, when only the start-up's row
    counts had run. Returns how many variants it launched."""
    num_tiles = triton.cdiv(logits.size(-1), block)
    by_bucket: dict[int, int] = {}
    for requested in range(1, num_tiles + 1):
        splits = triton.cdiv(num_tiles, triton.cdiv(num_tiles, requested))
        by_bucket.setdefault(triton.next_power_of_2(splits), splits)
    row = logits[:1]
    temperatures = torch.ones(1, device=logits.device)
    for splits in by_bucket.values():
        sample_temperature(row, temperatures, 0, block=block, num_splits=splits)
    return len(by_bucket)
