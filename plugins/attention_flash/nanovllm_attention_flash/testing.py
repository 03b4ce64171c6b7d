"""Random paged-attention batches for the backend tests and the kernel benchmark (no model needed).

A :class:`PagedCase` is one step of the engine seen by an attention layer: sequences with ``context_lens[i]``
tokens already in the paged cache and ``query_lens[i]`` new tokens, whose keys/values ``forward`` stores.
Blocks are handed out in a random order, so block tables are not contiguous.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from nanovllm_attention_flash.fp8_cache import (
    FP8_MAX,
    SCALE_BYTES,
    fp8_views,
    is_fp8_cache,
    store_fp8,
    to_fp8_cache,
)
from nanovllm_core import AttentionBackend, AttentionBatch


@dataclass
class PagedCase:
    batch: AttentionBatch
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, num_kv_heads, head_dim), cached context filled in;
    # or an FP8 cache (``fp8_cache``, after ``fp8()``)
    scale: float
    query_lens: list[int]
    context_lens: list[int]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    def kv_bytes_read(self) -> int:
        """Bytes of K and V a kernel must read once: the whole context of every sequence."""
        seq_lens = [c + q for c, q in zip(self.context_lens, self.query_lens)]
        if is_fp8_cache(self.kv_cache):  # one byte per value plus the row's scale
            return 2 * sum(seq_lens) * self.num_kv_heads * (self.head_dim + SCALE_BYTES)
        return 2 * sum(seq_lens) * self.num_kv_heads * self.head_dim * self.kv_cache.element_size()

    def qo_bytes(self) -> int:
        return 2 * self.q.numel() * self.q.element_size()

    def causal_flops(self) -> float:
        """Multiply-adds x 2 of QK^T and PV over the visible (causal) keys of every query."""
        total = 0
        for c, n in zip(self.context_lens, self.query_lens):
            total += n * c + n * (n + 1) // 2
        return 4.0 * total * self.num_heads * self.head_dim

    def backend(self, cls: type[AttentionBackend], **options) -> AttentionBackend:
        return cls(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.scale,
            block_size=self.batch.block_size,
            dtype=self.q.dtype,
            device=self.q.device,
            **options,
        )

    def run(self, backend: AttentionBackend, kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        """One ``forward`` on a private copy of the cache (or on ``kv_cache`` when given)."""
        cache = self.kv_cache.clone() if kv_cache is None else kv_cache
        return backend.forward(self.q, self.k, self.v, cache, backend.build_metadata(self.batch))

    def to(self, dtype: torch.dtype) -> PagedCase:
        """The same case with q/k/v and cache cast (e.g. float32 for a more exact reference); an FP8 cache
        stays as it is."""
        cache = self.kv_cache if is_fp8_cache(self.kv_cache) else self.kv_cache.to(dtype)
        return replace(self, q=self.q.to(dtype), k=self.k.to(dtype), v=self.v.to(dtype), kv_cache=cache)

    def fp8(self) -> PagedCase:
        """The same step on an FP8 cache (``kv_cache_dtype = "fp8"``): the cached context (and the NaN fill of
        unused slots) quantised with ``fp8_cache.to_fp8_cache``."""
        return replace(self, kv_cache=to_fp8_cache(self.kv_cache))

    def prestored(self) -> PagedCase:
        """The same step with its new keys/values already in (a copy of) the cache, written by the reference
        store (``fp8_cache.store_fp8`` for an FP8 cache), and every slot ``-1``: ``forward`` of any backend
        then stores nothing and only reads the cache, so two backends are compared on the same cache bytes."""
        cache = self.kv_cache.clone()
        slots = self.batch.slot_mapping
        if is_fp8_cache(cache):
            store_fp8(self.k, self.v, fp8_views(cache, self.batch.block_size, self.num_kv_heads, self.head_dim), slots)
        else:
            valid = slots >= 0
            cache[0].view(-1, self.num_kv_heads, self.head_dim)[slots[valid]] = self.k[valid].to(cache.dtype)
            cache[1].view(-1, self.num_kv_heads, self.head_dim)[slots[valid]] = self.v[valid].to(cache.dtype)
        batch = replace(self.batch, slot_mapping=torch.full_like(slots, -1))
        return replace(self, kv_cache=cache, batch=batch)


def make_case(
    query_lens: Sequence[int],
    context_lens: Sequence[int] | None = None,
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_pad_rows: int = 0,
    table_width: int | None = None,
    spare_blocks: int = 3,
    num_blocks: int | None = None,
    unused_fill: float = float("nan"),
    seed: int = 0,
) -> PagedCase:
    """Build a step: sequence ``i`` has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones.

    ``num_pad_rows`` appends CUDA-graph style padding rows (one query token, ``seq_len == 0``, slot ``-1``,
    block table of zeros). ``table_width`` widens the block table (static capacity, as under CUDA graphs).
    The cache holds ``num_blocks`` blocks (default: what the sequences need + ``spare_blocks`` + block 0).
    Cache slots that hold no token are filled with ``unused_fill`` (NaN by default, to catch kernels that
    read past a sequence's end without masking).
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = random.Random(seed)
    query_lens = list(query_lens)
    context_lens = list(context_lens) if context_lens is not None else [0] * len(query_lens)
    assert len(context_lens) == len(query_lens)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_needed) + 1
    num_blocks = num_blocks or needed + spare_blocks
    assert num_blocks >= needed, f"{num_blocks} blocks cannot hold {needed - 1} blocks of tokens"
    ids = list(range(1, num_blocks))  # block 0 stays unused: padding rows point at it
    rnd.shuffle(ids)
    width = max([*blocks_needed, 1, table_width or 0])
    tables, used = [], 0
    for nb in blocks_needed:
        tables.append(ids[used : used + nb] + [0] * (width - nb))
        used += nb
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, unused_fill, dtype=dtype, device=dev)
    cached = [t[p // block_size] * block_size + p % block_size for c, t in zip(context_lens, tables) for p in range(c)]
    if cached:
        values = torch.randn((2, len(cached), num_kv_heads, head_dim), generator=gen, device=dev).to(dtype)
        kv_cache.view(2, -1, num_kv_heads, head_dim)[:, torch.tensor(cached, device=dev)] = values
    slots: list[int] = []
    for ctx, seq_len, table in zip(context_lens, seq_lens, tables):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len))
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    for _ in range(num_pad_rows):
        tables.append([0] * width)
        seq_lens.append(0)
        slots.append(-1)
        qsl.append(qsl[-1] + 1)
    num_tokens = qsl[-1]
    q = torch.randn((num_tokens, num_heads, head_dim), generator=gen, device=dev).to(dtype)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen, device=dev).to(dtype)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen, device=dev).to(dtype)
    batch = AttentionBatch.build(qsl, seq_lens, tables, slots, block_size, dev)
    return PagedCase(
        batch=batch,
        q=q,
        k=k,
        v=v,
        kv_cache=kv_cache,
        scale=1.0 / math.sqrt(head_dim),
        query_lens=query_lens + [1] * num_pad_rows,
        context_lens=context_lens + [0] * num_pad_rows,
    )


def reference(case: PagedCase, torch_backend_cls: type[AttentionBackend]) -> torch.Tensor:
    """The ``torch`` backend's output computed in float32 (padding rows of ``seq_len == 0`` set to zero)."""
    exact = case.to(torch.float32)
    real = [i for i, s in enumerate(case.batch.seq_lens_cpu) if s > 0]
    out = torch.zeros_like(exact.q)
    if real:
        qsl = case.batch.query_start_loc_cpu
        n = len(real)
        assert real == list(range(n)), "padding rows must come last"
        sub = case.batch.head(n)
        backend = exact.backend(torch_backend_cls)
        cache = exact.kv_cache.clone()
        out[: qsl[n]] = backend.forward(exact.q[: qsl[n]], exact.k[: qsl[n]], exact.v[: qsl[n]], cache, sub)
    return out


def e4m3_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``fp8_cache.quantize_fp8(x)`` must return, computed exactly in float64 on the CPU without any float8
    conversion: ``(values as float32, scales, ties)``, ``ties`` marking the values that sat exactly halfway
    between two e4m3 numbers (rounded to the even one).

    ``scale`` is ``amax / 448`` correctly rounded to float32 and the scaled value ``x / scale`` too (a float64
    quotient of float32 numbers rounded to float32 is the correctly rounded float32 quotient: 53 >= 2 * 24 + 2);
    then round to nearest even on e4m3's grid: step ``2**(e - 3)`` for ``2**e <= |y| < 2**(e + 1)``, ``2**-9``
    below ``2**-6`` (subnormals).
    """
    x64 = x.detach().double().cpu()
    scale = (x64.abs().amax(-1) / FP8_MAX).float()
    divisor = torch.where(scale > 0, scale, 1.0).double().unsqueeze(-1)
    y = (x64 / divisor).float().double().clamp(-FP8_MAX, FP8_MAX)
    _, exponent = torch.frexp(y)  # |y| = m * 2**exponent, 0.5 <= m < 1
    step = torch.ldexp(torch.ones_like(y), (exponent - 1).clamp_min(-6) - 3)
    steps = y / step  # exact: a power-of-two division
    ties = steps - steps.floor() == 0.5
    return (torch.round(steps) * step).float(), scale, ties  # torch.round: half to even, keeps -0.0


def bf16_rows(num_rows: int, head_dim: int, seed: int) -> torch.Tensor:
    """float32 rows holding bfloat16 values (what the model hands the cache) of magnitudes 2**-20 to 2**12, an
    all-zero row and signed zeros. With 8-bit inputs about 0.5% of the scaled values land exactly halfway between
    two e4m3 numbers, so a scale one float32 ulp off moves some of them one e4m3 step."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.ldexp(torch.ones(num_rows, 1), torch.randint(-20, 13, (num_rows, 1), generator=gen))
    x = (torch.randn(num_rows, head_dim, generator=gen) * magnitude).bfloat16().float()
    x[0] = 0.0
    x[1, :4] = torch.tensor([0.0, -0.0, 2.0**-100, -(2.0**-100)])  # signed zeros and values that round to them
    return x


def record_tma_use(monkeypatch) -> list[bool]:
    """Record, for each prefill launch from now on, whether it got TMA tensor descriptors (``monkeypatch``: a
    pytest ``MonkeyPatch``, which undoes the wrapping)."""
    from nanovllm_attention_flash import triton_kernels

    used: list[bool] = []
    original = triton_kernels.kv_tensor_descriptors

    def spy(*args, **kwargs):
        descriptors = original(*args, **kwargs)
        used.append(descriptors is not None)
        return descriptors

    monkeypatch.setattr(triton_kernels, "kv_tensor_descriptors", spy)
    return used


STEP_KINDS = ["decode", "prefill", "prefix_hit", "chunked", "mixed"]
# the GPU tests' cases, (kind, num_heads, num_kv_heads, head_dim, block_size, dtype): a GQA sweep at the default
# block size, a block-size sweep, float16, other head sizes
GPU_CASES = (
    [(k, 2 * g, 2, 128, 256, torch.bfloat16) for k in STEP_KINDS for g in (1, 2, 4, 8)]
    + [(k, 16, 8, 128, bs, torch.bfloat16) for k in STEP_KINDS for bs in (16, 64, 128)]
    + [(k, 8, 2, 128, 128, torch.float16) for k in STEP_KINDS]
    + [(k, 8, 4, 64, 64, torch.bfloat16) for k in ("decode", "chunked", "mixed")]
    + [(k, 4, 2, 256, 64, torch.bfloat16) for k in ("decode", "chunked", "mixed")]
)


def case_id(case: tuple) -> str:
    """A ``GPU_CASES`` entry as a test id."""
    kind, h, kvh, d, bs, dtype = case
    return f"{kind}-q{h}kv{kvh}-d{d}-bs{bs}-{str(dtype).removeprefix('torch.')}"


def step_lengths(kind: str, block_size: int, seed: int, small: bool = False) -> tuple[list[int], list[int], int]:
    """(query_lens, context_lens, padding rows) of a ragged step of one of ``STEP_KINDS``: decode rows (with three
    padding rows, as in a CUDA-graph bucket), fresh prompts, prompts after whole cached blocks, prompt chunks over a
    cached context, or decode rows and chunks shuffled. ``small``: a step for the CPU, a twentieth of the tokens."""
    rnd = random.Random(seed)
    tokens = 20 if small else 1  # divides every length limit
    rows, chunks = (9, 3) if small else (37, 7)

    def draw(count: int, low: int, high: int) -> list[int]:
        return [rnd.randint(low, max(low, high // tokens)) for _ in range(count)]

    if kind == "decode":
        return [1] * rows, draw(rows, 0, 3000), 3
    if kind == "prefill":
        return draw(chunks, 1, 700), [0] * chunks, 0
    if kind == "prefix_hit":
        return draw(chunks, 1, 300), [block_size * n for n in draw(chunks, 1, 1024 // block_size)], 0
    if kind == "chunked":
        return draw(chunks, 2, 512), draw(chunks, 1, 2000), 0
    if kind == "mixed":
        q, c = [1] * (rows // 2) + draw(3, 2, 400), draw(rows // 2, 1, 2000) + draw(3, 0, 900)
        order = list(range(len(q)))
        rnd.shuffle(order)
        return [q[i] for i in order], [c[i] for i in order], 0
    raise ValueError(f"unknown step kind {kind!r}: {STEP_KINDS}")
