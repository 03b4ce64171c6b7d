"""The ``triton`` backend's FP8 KV cache and its warm-up, kernels in Triton's interpreter on CPU.

The FP8 kernels against the ``torch`` backend on the same FP8 cache (float32: both compute on identical
dequantised values, so the bound is tight), the store kernel bit for bit against PyTorch's quantisation, and
``warmup_steps``: every kernel variant a step launches (Triton's own specialisation key: dtypes, 16-byte
alignment, integers equal to 1 or divisible by 16, constexprs) is one the warm-up launched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_attention_flash import TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from nanovllm_attention_flash import triton_kernels as tk  # noqa: E402
from nanovllm_attention_flash.fp8_cache import fp8_cache_shape, fp8_views, store_fp8  # noqa: E402
from nanovllm_attention_flash.testing import (  # noqa: E402
    PagedCase,
    bf16_rows,
    e4m3_reference,
    make_case,
    record_tma_use,
    reference,
)

KINDS = {
    "decode": ([1] * 5, [1, 15, 16, 40, 77]),
    "prefill": ([1, 7, 20, 45], [0] * 4),
    "chunked": ([9, 16, 30], [13, 37, 50]),
    "mixed": ([1, 12, 1, 5, 1], [30, 0, 7, 21, 64]),
}


def assert_matches_torch(case: PagedCase, out: torch.Tensor, tol: float = 2e-5) -> None:
    assert not torch.isnan(out).any(), "NaN in the output"
    torch.testing.assert_close(out.float(), reference(case, TorchAttentionBackend), atol=tol, rtol=tol)


CASES = [("decode", 4, 2, 16), ("prefill", 4, 1, 16), ("chunked", 4, 2, 32), ("mixed", 4, 1, 16), ("mixed", 2, 2, 32)]


@pytest.mark.parametrize(
    "kind,num_heads,num_kv_heads,block_size", CASES, ids=[f"{c[0]}-{c[1]}q{c[2]}kv-bs{c[3]}" for c in CASES]
)
def test_fp8_matches_torch_backend(kind: str, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """Ragged steps on an FP8 cache whose unused slots hold NaN (values and scales)."""
    case = make_case(
        *KINDS[kind],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        num_pad_rows=2 if kind == "decode" else 0,
        seed=block_size + num_heads,
    ).fp8()
    cache = case.kv_cache.clone()
    assert_matches_torch(case, case.run(case.backend(TritonAttentionBackend), cache))
    expected = case.kv_cache.clone()  # the torch backend's store, bit for bit
    case.run(case.backend(TorchAttentionBackend), expected)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_fp8_decode_split_counts(num_kv_splits: int) -> None:
    case = make_case([1] * 3, [3, 16, 97], num_heads=4, num_kv_heads=1, block_size=16, num_pad_rows=1).fp8()
    assert_matches_torch(case, case.run(case.backend(TritonAttentionBackend, num_kv_splits=num_kv_splits)))


def test_fp8_prefill_through_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TMA variant: descriptors over the e4m3 values; diagonal tiles read never-written NaN slots."""
    used = record_tma_use(monkeypatch)
    case = make_case(*KINDS["chunked"], num_heads=4, num_kv_heads=2, block_size=16, seed=3).fp8()
    backend = case.backend(TritonAttentionBackend, prefill_use_tma=True, prefill_block_m=16, prefill_block_n=16)
    assert_matches_torch(case, case.run(backend))
    assert used == [True]


def test_fp8_float16() -> None:
    case = make_case(*KINDS["mixed"], num_heads=4, num_kv_heads=2, block_size=16, dtype=torch.float16).fp8()
    assert_matches_torch(case, case.run(case.backend(TritonAttentionBackend)), tol=2e-3)


BF16_CASES = [("decode", 1), ("decode", 4), ("chunked", 1), ("mixed", 1)]


@pytest.mark.parametrize("kind,num_kv_splits", BF16_CASES, ids=[f"{k}-{s}split" for k, s in BF16_CASES])
def test_fp8_bfloat16_against_float32(kind: str, num_kv_splits: int) -> None:
    """A bf16 model's attention on an FP8 cache (dots in float16, the value scales on the probabilities; decode
    and prefill kernels) is as close to exact float32 attention over the same e4m3 cache as the bf16 output's own
    rounding allows: one bf16 step (a relative 2**-7) of the exact value."""
    case = make_case(*KINDS[kind], num_heads=4, num_kv_heads=2, block_size=16, dtype=torch.bfloat16, seed=5).fp8()
    out = case.run(case.backend(TritonAttentionBackend, num_kv_splits=num_kv_splits))
    exact = reference(case, TorchAttentionBackend)  # float32 on the dequantised cache
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=2**-7)


def test_fp8_store_kernel_is_bit_exact() -> None:
    """Rows of very different magnitudes, an all-zero row, 3 KV heads (a masked fourth), padding slots."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(7, 3, 64, generator=gen) * torch.tensor([1e-4, 1.0, 500.0]).view(1, 3, 1)
    v = torch.randn(7, 3, 64, generator=gen)
    k[2, 1] = 0.0
    v[4, 0, :5] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 3.0])  # subnormals and signed zeros after scaling
    slots = torch.tensor([17, -1, 63, 0, 5, 40, -1])
    ours = torch.zeros(fp8_cache_shape(4, 16, 3, 64), dtype=torch.uint8)
    views = fp8_views(ours, 16, 3, 64)
    tk.store_kv(k, v, views.values[0], views.values[1], slots, views.scales[0], views.scales[1])
    expected = torch.zeros_like(ours)
    store_fp8(k, v, fp8_views(expected, 16, 3, 64), slots)
    assert torch.equal(ours, expected)


def test_fp8_store_kernel_writes_every_e4m3_code() -> None:
    """Rows whose largest value is 448 (scale 1: every value is stored as it is) holding each of the 254
    non-NaN e4m3 values, -0 and the subnormals included: the cache holds exactly their codes."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    rows = torch.full((6, 64), 448.0)
    flat = torch.cat([values, torch.zeros(6 * 63 - values.numel())])
    rows[:, 1:] = flat.view(6, 63)
    k = rows.view(6, 1, 64)
    cache = torch.zeros(fp8_cache_shape(1, 16, 1, 64), dtype=torch.uint8)
    views = fp8_views(cache, 16, 1, 64)
    tk.store_kv(k, k, views.values[0], views.values[1], torch.arange(6), views.scales[0], views.scales[1])
    stored = views.values[0][0, :6, 0].contiguous().view(torch.uint8)[:, 1:].reshape(-1)[: codes.numel()]
    assert torch.equal(stored, codes), (stored != codes).nonzero().flatten().tolist()
    assert torch.equal(views.scales[0][0, 0, :6], torch.ones(6))


def test_fp8_store_kernel_rounds_like_the_exact_reference() -> None:
    """bfloat16 rows with many values exactly halfway between two e4m3 numbers (``testing.bf16_rows``): the
    kernel's values and scales equal the exact float64 reference (ties to even, signed zeros kept)."""
    rows = bf16_rows(2 * 32 * 2, 64, seed=4)  # (key, value) x 32 tokens x 2 KV heads
    k, v = rows.view(2, 32, 2, 64)
    cache = torch.zeros(fp8_cache_shape(2, 16, 2, 64), dtype=torch.uint8)
    views = fp8_views(cache, 16, 2, 64)
    tk.store_kv(k, v, views.values[0], views.values[1], torch.arange(32), views.scales[0], views.scales[1])
    ref_values, ref_scales, ties = e4m3_reference(rows.view(2, 32, 2, 64))
    assert ties.any()
    values = views.values.flatten(1, 2).float()  # [2, 32 tokens, 2 heads, 64]
    assert torch.equal(values, ref_values) and torch.equal(values.signbit(), ref_values.signbit())
    assert torch.equal(views.scales.transpose(2, 3).flatten(1, 2), ref_scales)


# ----------------------------------------------------------------------------------------------------
# Warm-up coverage
# ----------------------------------------------------------------------------------------------------


def variant_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton's JIT keys a compiled variant on: each runtime argument's specialisation, constexprs, options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    unspecialised = set(kernel.kwargs.get("do_not_specialize", ()))
    spec = tuple(
        (name, native_specialize_impl(BaseBackend, arg, False, name not in unspecialised, True))
        for name, arg in zip(kernel.arg_names, args)
    )
    return (kernel.__name__, spec, tuple(sorted(kwargs.items())))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> set:
    """Every kernel launch from here on adds its variant key to the returned set."""
    seen: set = set()
    real = tk._kernels_for(torch.device("cpu"))

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.add(variant_key(self.kernel, args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    recorded = tk._KernelSet(**{f.name: Recorder(getattr(real, f.name)) for f in dataclasses.fields(real)})
    monkeypatch.setattr(tk, "_kernels_for", lambda device: recorded)
    return seen


# The split plan's batch buckets in the warm-up tests: small, so that the warm-up's batch for each bucket (and a
# step's batch above the smallest) is quick to interpret; the real ones are checked without running a kernel.
SMALL_SEQS_BUCKETS = (8, 16, 32)


def engine_like_steps(fp8: bool) -> list[PagedCase]:
    """Steps as the engine makes them: decode at several batch sizes (the kernel's batch buckets, as in
    ``SMALL_SEQS_BUCKETS``) and block-table widths (CUDA-graph padding included, so several KV-split counts),
    prefill, chunked prefill, mixed, a mixed batch without host lengths; q/k/v as views of one fused projection
    output."""
    common = dict(num_heads=4, num_kv_heads=2, block_size=16)
    cases = [
        make_case([1] * 3, [5, 30, 2], num_pad_rows=1, table_width=8, **common),
        make_case([1], [200], table_width=16, **common),
        make_case([1] * 2, [40, 1], table_width=1 + 40 // 16, **common),
        make_case([1] * 12, [3] * 12, table_width=1, **common),  # above the smallest bucket
        make_case(*KINDS["prefill"], **common),
        make_case(*KINDS["chunked"], **common),
        make_case(*KINDS["mixed"], **common),
    ]
    no_host = make_case(*KINDS["mixed"], **common)
    no_host.batch.query_start_loc_cpu = []
    cases.append(no_host)
    for case in cases:  # fused qkv: strided views at offsets, as the model hands them over
        qkv = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
        q_size, kv_size = case.q[0].numel(), case.k[0].numel()
        case.q = qkv[:, :q_size].view_as(case.q)
        case.k = qkv[:, q_size : q_size + kv_size].view_as(case.k)
        case.v = qkv[:, q_size + kv_size :].view_as(case.v)
    return [case.fp8() if fp8 else case for case in cases]


@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
@pytest.mark.parametrize("options", [{}, {"prefill_use_tma": True, "num_kv_splits": 2}], ids=["default", "tma"])
def test_warmup_launches_every_variant_a_step_meets(
    launches: set, fp8: bool, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tk, "SEQS_BUCKETS", SMALL_SEQS_BUCKETS)
    steps = engine_like_steps(fp8)
    backend = steps[0].backend(TritonAttentionBackend, **options)
    cache = steps[0].kv_cache.clone()
    backend.warmup(cache)  # interpreted kernels: nothing to compile, nothing launched
    assert not launches
    before = cache.clone()
    for q, k, v, metadata in backend.warmup_steps(cache):
        backend.forward(q, k, v, cache, metadata)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8)), "the warm-up wrote into the cache"
    warmed = set(launches)
    launches.clear()
    for case in steps:
        case.run(backend)
    assert {key[0] for key in launches} >= {"_prefill_kernel", "_decode_split_kernel"}
    missing = launches - warmed
    assert not missing, f"variants the warm-up did not compile: {sorted(missing)}"


def test_warmup_decodes_a_batch_in_every_split_plan_bucket() -> None:
    """With the real ``SEQS_BUCKETS`` (the test above runs the warm-up with ``SMALL_SEQS_BUCKETS``)."""
    case = make_case([1], [5], num_heads=4, num_kv_heads=2, block_size=16)
    steps = case.backend(TritonAttentionBackend).warmup_steps(case.kv_cache)
    decode_batches = [metadata.batch.num_seqs for *_, metadata in steps if metadata.decode_only]
    assert {tk.seqs_bucket(n) for n in decode_batches} >= set(tk.SEQS_BUCKETS)


def test_split_counts_fill_sixteen_warps_an_sm() -> None:
    """Four-warp programs: 4 an SM; one-warp programs: 16 an SM, so that a batch of ragged
    contexts does not fit one wave (where its longest sequence sets the time)."""
    # 132 SMs, 8 KV heads, a 4,096-token block table
    assert tk.choose_num_splits(256, 8, 4096, 64, 132, num_warps=4) == 1  # 2,048 programs >= 528
    assert tk.choose_num_splits(32, 8, 4096, 64, 132, num_warps=4) == 4  # 256 -> 1,024
    assert tk.choose_num_splits(256, 8, 4096, 32, 132, num_warps=1) == 2  # 2,048 < 2,112 -> 4,096
    assert tk.choose_num_splits(64, 8, 4096, 32, 132, num_warps=1) == 8
    assert tk.choose_num_splits(1, 8, 4096, 32, 132, num_warps=1) == tk.MAX_KV_SPLITS
    assert tk.choose_num_splits(1, 8, 64, 32, 132, num_warps=1) == 2  # no more splits than tiles


def test_an_fp8_cache_gets_its_own_decode_tile() -> None:
    """Two (or four) query heads a KV head on an FP8 cache: 32-key one-warp tiles, and the split counts chosen for them
    once warmup() has seen the cache; a 16-bit cache keeps the 64-key four-warp tile; the decode_* options set
    both tiles."""
    case = make_case([1] * 2, [5, 9], num_heads=4, num_kv_heads=2, block_size=64)
    fp8_case = case.fp8()
    backend = fp8_case.backend(TritonAttentionBackend)
    assert (backend.decode_config.block_n, backend.decode_config.num_warps) == (64, 4)
    assert (backend.fp8_decode_config.block_n, backend.fp8_decode_config.num_warps) == (32, 1)
    many = make_case([1] * 64, [3] * 64, num_heads=4, num_kv_heads=2, block_size=64).batch
    assert backend.build_metadata(many).num_splits == tk.choose_num_splits(
        64, 2, many.block_tables.shape[1] * 64, 64, backend._num_sms, num_warps=4
    )
    backend.warmup(fp8_case.kv_cache)  # on the CPU it compiles nothing, but sees the cache
    assert backend.build_metadata(many).num_splits == tk.choose_num_splits(
        64, 2, many.block_tables.shape[1] * 64, 32, backend._num_sms, num_warps=1
    )
    assert_matches_torch(fp8_case, fp8_case.run(backend))
    four = make_case([1], [5], num_heads=8, num_kv_heads=2, block_size=64).fp8().backend(TritonAttentionBackend)
    assert four.fp8_decode_config.num_warps == 1  # four query heads a KV head (the 8B's) too
    many_heads = make_case([1], [5], num_heads=32, num_kv_heads=1, block_size=64).fp8()
    assert many_heads.backend(TritonAttentionBackend).fp8_decode_config.num_warps == 4  # a 32-row query tile
    both = case.backend(TritonAttentionBackend, decode_block_n=16, decode_num_warps=2)
    assert both.decode_config.block_n == both.fp8_decode_config.block_n == 16
    assert both.decode_config.num_warps == both.fp8_decode_config.num_warps == 2
