"""GPU checks of the ``triton`` and ``flash_attn`` backends against the ``torch`` backend (float32 reference).

Ragged batches with shuffled block tables: decode (with CUDA-graph padding rows), plain prefill, prefix-cache
hits, chunked prefill over a cached context and mixed batches; GQA ratios 1/2/4/8, block sizes 16/64/128/256,
head sizes 64/128/256, bfloat16 and float16; the triton backend with its default options and with the prefill
kernel's TMA variant (``prefill_use_tma``). FP8 cache (``kv_cache_dtype = "fp8"``), in two separate checks: the
store kernel's e4m3 bytes and scales equal the torch reference's (``fp8_cache.store_fp8``, on CUDA and on the
CPU) bit for bit, and the triton attention kernels reading the same FP8 cache (the step's keys/values stored by
the reference) match the torch backend reading it at the 16-bit tolerance. Also: decode captured in a CUDA graph
and replayed on new data, and ``TritonAttentionBackend.warmup`` leaving no kernel variant to compile.
A timing table (median of 10 runs of ``forward``, store included) is printed at the end (``-s`` shows it).

Run: ``python -m pytest plugins/attention_flash/tests -m gpu -x -q -s``
"""

from __future__ import annotations

import dataclasses
import random
import time
import zlib

import pytest
import torch
from nanovllm_attention_flash import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from nanovllm_attention_flash import triton_kernels as tk
from nanovllm_attention_flash.fp8_cache import fp8_views, store_fp8
from nanovllm_attention_flash.testing import (
    GPU_CASES as CASES,
)
from nanovllm_attention_flash.testing import (
    PagedCase,
    bf16_rows,
    case_id,
    e4m3_reference,
    make_case,
    reference,
)
from nanovllm_attention_flash.testing import step_lengths as lengths
from nanovllm_testing import cuda_median_ms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = {"triton": TritonAttentionBackend, "flash_attn": FlashAttnBackend}
# backend variants checked against the torch backend: name -> (backend, options)
VARIANTS = {
    "triton": (TritonAttentionBackend, {}),
    "triton_tma": (TritonAttentionBackend, {"prefill_use_tma": True}),  # prefill K/V through TMA descriptors
    "flash_attn": (FlashAttnBackend, {}),
    # FP8 cache: the attention kernels against the torch backend reading the same e4m3 values and scales
    "triton_fp8": (TritonAttentionBackend, {}),
    "triton_fp8_tma": (TritonAttentionBackend, {"prefill_use_tma": True}),
}
FP8_VARIANTS = {"triton_fp8", "triton_fp8_tma"}
TOLERANCE = {torch.bfloat16: dict(atol=1e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
TIMINGS: list[tuple[str, str, float]] = []


def skip_unless_available(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    reason = cls.check_available(torch.device("cuda"), dtype, head_dim)
    if reason is None and block_size not in (cls.supported_block_sizes() or [block_size]):
        reason = f"block size {block_size} unsupported"
    if reason is not None:
        pytest.skip(f"{cls.name}: {reason}")


def skip_unless_fp8(cls) -> None:
    reason = cls.check_kv_cache_dtype("fp8", torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{cls.name}: {reason}")


def median_us(fn, reps: int = 10) -> float:
    return cuda_median_ms(fn, reps, warmup=2) * 1e3


@pytest.fixture(scope="module", autouse=True)
def timing_table():
    yield
    if TIMINGS:
        names = sorted({n for _, n, _ in TIMINGS})
        rows: dict[str, dict[str, float]] = {}
        for case, name, us in TIMINGS:
            rows.setdefault(case, {})[name] = us
        width = max(len(c) for c in rows)
        print(f"\n\nforward time, median of 10 (us)\n{'case':<{width}}  " + "  ".join(f"{n:>10}" for n in names))
        for case, by_name in rows.items():
            cells = "  ".join(f"{by_name[n]:>10.1f}" if n in by_name else f"{'-':>10}" for n in names)
            print(f"{case:<{width}}  {cells}")


def build(c, seed: int, name: str) -> PagedCase:
    kind, h, kvh, d, bs, dtype = c
    q, ctx, pads = lengths(kind, bs, seed)
    # NaN in never-written slots catches unmasked reads; flash-attn-4 needs finite rows in partly used pages
    fill = 0.0 if name == "flash_attn" else float("nan")
    return make_case(q, ctx, num_heads=h, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype=dtype, device="cuda",
                     num_pad_rows=pads, unused_fill=fill, seed=seed)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_matches_torch_backend(c, name: str) -> None:
    kind, h, kvh, d, bs, dtype = c
    cls, options = VARIANTS[name]
    if name.endswith("_tma") and kind == "decode":
        pytest.skip("decode steps do not run the prefill kernel")
    skip_unless_available(cls, dtype, d, bs)
    case = build(c, seed=zlib.crc32(case_id(c).encode()) % 1000, name=name)
    timed = case
    if name in FP8_VARIANTS:
        skip_unless_fp8(cls)
        # the attention kernels alone, on the reference's FP8 cache with the step's keys/values in it (the store
        # kernel has its own exact check, test_fp8_store_kernel_matches_torch_bit_for_bit); timed with the store
        timed = case.fp8()
        case = timed.prestored()
    backend = case.backend(cls, **options)
    out = case.run(backend)
    torch.cuda.synchronize()
    assert out.shape == case.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "non-finite output"
    ref = reference(case, TorchAttentionBackend)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    cache = timed.kv_cache.clone()
    metadata = backend.build_metadata(timed.batch)
    TIMINGS.append((case_id(c), name, median_us(lambda: backend.forward(case.q, case.k, case.v, cache, metadata))))
    if name == "triton" and bs == 256 and h == 16:  # the torch backend is slow: time it on one row of cases
        torch_backend = case.backend(TorchAttentionBackend)
        TIMINGS.append((case_id(c), "torch", median_us(lambda: case.run(torch_backend, cache), reps=3)))


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_fp8_store_kernel_matches_torch_bit_for_bit(c) -> None:
    """The triton store kernel quantises each step's new keys/values into the same bytes (e4m3 values, float32
    scales, the untouched NaN-filled slots) as ``fp8_cache.store_fp8`` on CUDA and on the CPU."""
    kind, h, kvh, d, bs, dtype = c
    skip_unless_available(TritonAttentionBackend, dtype, d, bs)
    skip_unless_fp8(TritonAttentionBackend)
    case = build(c, seed=zlib.crc32(case_id(c).encode()) % 1000, name="triton_fp8").fp8()
    ours = case.kv_cache.clone()
    views = fp8_views(ours, bs, kvh, d)
    slots = case.batch.slot_mapping
    tk.store_kv(case.k, case.v, views.values[0], views.values[1], slots, views.scales[0], views.scales[1])
    expected = case.prestored().kv_cache
    on_cpu = case.kv_cache.cpu()
    store_fp8(case.k.cpu(), case.v.cpu(), fp8_views(on_cpu, bs, kvh, d), slots.cpu())
    assert torch.equal(expected.cpu(), on_cpu), "store_fp8 differs between CUDA and the CPU"
    differ = (ours != expected).sum().item()
    assert differ == 0, f"{differ} of {ours.numel()} cache bytes differ from the torch reference's"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_store_kernel_rounds_like_the_exact_reference(dtype: torch.dtype) -> None:
    """Rows with many values exactly halfway between two e4m3 numbers (``testing.bf16_rows``), magnitudes from
    subnormal to large: the kernel's and CUDA ``store_fp8``'s values and scales equal the exact float64 reference
    (ties to even, signed zeros kept)."""
    skip_unless_fp8(TritonAttentionBackend)
    rows = bf16_rows(2 * 512 * 8, 128, seed=6).view(2, 512, 8, 128)
    k, v = rows.to(dtype).cuda()
    ref_values, ref_scales, ties = e4m3_reference(rows.to(dtype))
    assert ties.any()
    slots = torch.arange(512, device="cuda")
    for store in ("triton", "torch"):
        cache = torch.zeros((2, 4 * 128 * 8 * (128 + 4)), dtype=torch.uint8, device="cuda")
        views = fp8_views(cache, 128, 8, 128)
        if store == "triton":
            tk.store_kv(k, v, views.values[0], views.values[1], slots, views.scales[0], views.scales[1])
        else:
            store_fp8(k, v, views, slots)
        values = views.values.flatten(1, 2).float().cpu()
        assert torch.equal(values, ref_values), store
        assert torch.equal(values.signbit(), ref_values.signbit()), store
        assert torch.equal(views.scales.transpose(2, 3).flatten(1, 2).cpu(), ref_scales), store


@pytest.mark.parametrize("num_kv_splits", [1, 4, 64])
def test_triton_decode_split_counts(num_kv_splits: int) -> None:
    c = ("decode", 16, 8, 128, 64, torch.bfloat16)
    skip_unless_available(TritonAttentionBackend, torch.bfloat16, 128, 64)
    case = build(c, seed=7, name="triton")
    out = case.run(case.backend(TritonAttentionBackend, num_kv_splits=num_kv_splits))
    torch.testing.assert_close(out.float(), reference(case, TorchAttentionBackend), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_triton_decode_long_contexts_among_short_ones(fp8: bool) -> None:
    """Three 20k-token contexts among 80 1k-token ones, one split a sequence on average: the long ones take many
    splits, merged by their last; twice on one cache (the second launch finds its counters reset)."""
    skip_unless_available(TritonAttentionBackend, torch.bfloat16, 128, 256)
    case = make_case([1] * 83, [1023] * 80 + [20479] * 3, num_heads=16, num_kv_heads=8, head_dim=128,
                     block_size=256, dtype=torch.bfloat16, device="cuda", unused_fill=float("nan"), seed=3)
    if fp8:
        skip_unless_fp8(TritonAttentionBackend)
        case = case.fp8().prestored()  # both backends on the same cache bytes, as in test_matches_torch_backend
    backend = case.backend(TritonAttentionBackend)
    expected = reference(case, TorchAttentionBackend)
    cache = case.kv_cache.clone()
    for _ in range(2):
        out = case.run(backend, cache)
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("name", [*BACKENDS, "triton_fp8"])
def test_decode_cuda_graph_replays_with_new_data(name: str) -> None:
    """Capture ``forward`` for a fixed batch of 40 sequences + 8 padding rows over a static 48-block table,
    replay it after copying another step's data into the same tensors, compare with eager ``forward``."""
    cls = VARIANTS[name][0]
    bs = 128
    skip_unless_available(cls, torch.bfloat16, 128, bs)
    if name in FP8_VARIANTS:
        skip_unless_fp8(cls)
    assert cls.supports_cuda_graph
    fill = 0.0 if name == "flash_attn" else float("nan")

    def step(seed: int) -> PagedCase:
        rnd = random.Random(seed)
        case = make_case([1] * 40, [rnd.randint(0, 5000) for _ in range(40)], num_heads=16, num_kv_heads=8,
                         head_dim=128, block_size=bs, dtype=torch.bfloat16, device="cuda", num_pad_rows=8,
                         table_width=48, num_blocks=1700, unused_fill=fill, seed=seed)
        return case.fp8() if name in FP8_VARIANTS else case

    first, second = step(1), step(2)
    assert first.kv_cache.shape == second.kv_cache.shape
    static = first  # its tensors are the graph's static inputs
    cache = static.kv_cache.clone()
    backend = static.backend(cls)
    metadata = backend.build_metadata(static.batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(static.q, static.k, static.v, cache, metadata)  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(static.q, static.k, static.v, cache, metadata)
    for dst, src in [(static.q, second.q), (static.k, second.k), (static.v, second.v), (cache, second.kv_cache)]:
        dst.copy_(src)
    b, nb = static.batch, second.batch
    for dst, src in [(b.query_start_loc, nb.query_start_loc), (b.seq_lens, nb.seq_lens),
                     (b.block_tables, nb.block_tables), (b.slot_mapping, nb.slot_mapping)]:
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = second.run(second.backend(cls))
    torch.testing.assert_close(graph_out, eager, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(graph_out.float(), reference(second, TorchAttentionBackend), **TOLERANCE[torch.bfloat16])


def compiled_variants() -> int:
    """Kernel variants Triton has compiled (in this process) for the triton backend's kernels."""
    kernels = tk._kernels_for(torch.device("cuda"))
    jitted = [getattr(kernels, f.name) for f in dataclasses.fields(kernels)]
    return sum(len(cache[0]) for kernel in jitted for cache in kernel.device_caches.values())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("options", [{}, {"prefill_use_tma": False}], ids=["default", "pointers"])
def test_triton_warmup_leaves_nothing_to_compile(fp8: bool, options: dict) -> None:
    """After ``warmup`` on one cache, steps of every kind (decode at many batch sizes and block-table widths, so
    many split counts; prefill; chunked; mixed; CUDA-graph padding) compile no further kernel variant."""
    skip_unless_available(TritonAttentionBackend, torch.bfloat16, 128, 256)
    if fp8:
        skip_unless_fp8(TritonAttentionBackend)
    rnd = random.Random(0)
    common = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=256, dtype=torch.bfloat16, device="cuda",
                  unused_fill=0.0)
    cases = [make_case([1] * n, [rnd.randint(1, 4000) for _ in range(n)], num_pad_rows=pad, table_width=width,
                       **common) for n, pad, width in ((1, 0, 1), (3, 5, 16), (40, 8, 17), (256, 0, 4), (7, 0, 64))]
    for kind in ("prefill", "prefix_hit", "chunked", "mixed"):
        query_lens, context_lens, _ = lengths(kind, 256, 3)
        cases.append(make_case(query_lens, context_lens, **common))
    cases = [case.fp8() if fp8 else case for case in cases]
    tk._kernel_set.cache_clear()  # fresh kernels: nothing compiled in this process yet
    backend = cases[0].backend(TritonAttentionBackend, **options)
    start = time.perf_counter()
    backend.warmup(cases[0].kv_cache.clone())
    warmed = compiled_variants()
    print(f"\nwarm-up ({'fp8' if fp8 else 'bf16'} cache, {options or 'default'}): {warmed} kernel variants in "
          f"{time.perf_counter() - start:.1f} s")
    assert warmed > 0
    for case in cases:
        case.run(backend)
    torch.cuda.synchronize()
    assert compiled_variants() == warmed, "a step compiled a kernel variant the warm-up did not"
