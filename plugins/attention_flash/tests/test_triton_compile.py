"""The ``triton`` backend's kernels compile for Hopper (sm_90) without a GPU, and use the intended instructions.

Triton's interpreter (``test_triton_interpret.py``) checks the arithmetic but accepts code the compiler would
reject; this compiles each kernel ahead of time for ``cuda:90`` with the default tiles (head_dim 128, bf16,
256-token blocks, arguments specialised as the JIT does for 16-aligned pointers and strides) and checks the
PTX: 16-byte ``cp.async`` key/value loads in the attention kernels (kept in flight across iterations by the
prefill pipeline), TMA loads in the prefill kernel's TMA variant, tensor-core MMAs, 16-byte store copies.
"""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")

from nanovllm_attention_flash import triton_kernels as tk  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # pragma: no cover - another Triton layout
    pytest.skip(f"Triton's ahead-of-time compile API is not available: {exc}", allow_module_level=True)

POINTERS = {
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "KEY_CACHE": "*bf16", "VALUE_CACHE": "*bf16", "OUT": "*bf16",
    "KEY_SCALES": "*bf16", "VALUE_SCALES": "*bf16",  # unused placeholders with a 16-bit cache
    "PART_OUT": "*fp32", "PART_LSE": "*fp32", "BLOCK_TABLES": "*i32", "SEQ_LENS": "*i32", "QUERY_START_LOC": "*i32",
    "SLOTS": "*i64", "COUNTERS": "*i32", "PLAN": "*i32",
}
# an FP8 cache: e4m3 values and float32 scales
FP8_POINTERS = {"KEY_CACHE": "*fp8e4nv", "VALUE_CACHE": "*fp8e4nv", "KEY_SCALES": "*fp32", "VALUE_SCALES": "*fp32"}


def compile_ptx(
    fn,
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    descriptors: dict | None = None,
    fp8: bool = False,
    byte_caches: bool = False,
) -> str:
    """PTX of ``fn`` for sm_90; ``descriptors`` maps parameters that are host tensor descriptors to their type;
    ``fp8``: the cache pointers are an FP8 cache's (``byte_caches``: as bytes, as the FP8 store gets them)."""
    pointers = {**POINTERS, **FP8_POINTERS} if fp8 else POINTERS
    if byte_caches:
        pointers = {**pointers, "KEY_CACHE": "*u8", "VALUE_CACHE": "*u8"}
    params = list(inspect.signature(fn).parameters)
    signature, attrs = {}, {}
    for i, name in enumerate(params):
        if name in constexprs:
            signature[name] = "constexpr"
        elif descriptors and name in descriptors:
            signature[name] = descriptors[name]
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(JITFunction(fn), signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm["ptx"]


def count(pattern: str, ptx: str) -> int:
    return len(re.findall(pattern, ptx))


CP_ASYNC_16 = r"cp\.async\.cg\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*0x10"


def decode_constexprs(cfg: tk.DecodeConfig, fp8: bool = False) -> dict:
    """As ``decode_attention`` sets them for a bf16 model (float16 dots with an FP8 cache)."""
    return dict(GROUP=2, BLOCK_H=16, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_N=cfg.block_n, MERGE_BLOCK=16,
                KV_FP8=fp8, HALF_DOTS=fp8, DOT_PRECISION="tf32")


def test_decode_kernel_compiles_for_sm90() -> None:
    cfg = tk.default_decode_config(128, 256)
    ptx = compile_ptx(
        tk._decode_split_kernel,
        decode_constexprs(cfg, fp8=False),
        cfg.num_warps, cfg.num_stages,
    )
    assert count(CP_ASYNC_16, ptx) >= 16, "K/V tiles should stream with 16-byte cp.async"
    assert count(r"mma\.sync", ptx) > 0


def test_decode_kernel_merges_its_splits_in_place() -> None:
    """The last split of a sequence merges: an acquire-release count at GPU scope, then the partials read past
    L1 (``.cg``: another SM wrote them, and this SM's L1 may hold an earlier launch's)."""
    cfg = tk.default_decode_config(128, 256)
    ptx = compile_ptx(tk._decode_split_kernel, decode_constexprs(cfg), cfg.num_warps, cfg.num_stages)
    assert count(r"atom\.global\.(gpu\.)?acq_rel\.(gpu\.)?add", ptx) > 0
    assert count(r"ld\.global\.cg", ptx) > 0


def test_split_plan_kernel_compiles_for_sm90() -> None:
    """The step's split plan (once a step, before the first layer's decode kernel): 16-byte-aligned int32 rows."""
    ptx = compile_ptx(tk._split_plan_kernel, dict(BLOCK_N=64, SEQS_P2=256, ROWS=32, PDL=False), 4, 1)
    assert count(r"st\.global", ptx) > 0


def prefill_constexprs(cfg: tk.PrefillConfig, use_tma: bool, fp8: bool = False) -> dict:
    return dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                SEQ_CHUNK=tk.PREFILL_SEQ_CHUNK, SKIP_SINGLE=True, USE_TMA=use_tma, KV_FP8=fp8, HALF_DOTS=fp8,
                DOT_PRECISION="tf32")


def test_prefill_kernel_compiles_for_sm90() -> None:
    cfg = tk.default_prefill_config(128, 256)
    ptx = compile_ptx(tk._prefill_kernel, prefill_constexprs(cfg, False), cfg.num_warps, cfg.num_stages)
    assert count(CP_ASYNC_16, ptx) >= 16
    assert count(r"wgmma\.mma_async", ptx) > 0, "Hopper prefill should use wgmma"


@pytest.mark.parametrize("num_stages", [3, 4])
def test_prefill_pipeline_keeps_key_value_copies_in_flight(num_stages: int) -> None:
    """With ``num_stages`` buffers the main loop waits only for the oldest tile's copies (K and V: one group each),
    leaving ``2 * (num_stages - 2)`` groups in flight. A block-table entry loaded in the same iteration as the
    tile it addresses would be pipelined as one more async copy, and the loop would drain every copy each
    iteration (``cp.async.wait_group 0``) to read it."""
    cfg = tk.PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=num_stages)
    ptx = compile_ptx(tk._prefill_kernel, prefill_constexprs(cfg, False), cfg.num_warps, cfg.num_stages)
    waits = {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}
    assert 2 * (num_stages - 2) in waits, f"K/V copies are not kept in flight: wait_group {sorted(waits)}"


def test_prefill_tma_variant_compiles_for_sm90() -> None:
    cfg = tk.PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True)
    desc = f"tensordesc<bf16[{cfg.block_n}, 128]>"
    ptx = compile_ptx(tk._prefill_kernel, prefill_constexprs(cfg, True), cfg.num_warps, cfg.num_stages,
                      descriptors={"KEY_CACHE": desc, "VALUE_CACHE": desc})
    assert count(r"cp\.async\.bulk\.tensor\.2d", ptx) >= 4, "K/V tiles should load through TMA"
    assert count(CP_ASYNC_16, ptx) == 0, "no K/V tile should fall back to cp.async"
    assert count(r"wgmma\.mma_async", ptx) > 0


def test_store_kernel_compiles_for_sm90() -> None:
    ptx = compile_ptx(tk._store_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P2=8, DIM_P2=128, BLOCK_SIZE=256,
                                                KV_FP8=False), 4, 1)
    assert count(r"st\.global\S*\.v4", ptx) >= 2


def test_decode_pipeline_keeps_key_value_copies_in_flight() -> None:
    """The decode loop loads each tile's block-table entry one tile ahead, as the prefill loop does, so its
    K/V copies stay in flight across iterations (no ``cp.async.wait_group 0`` inside the loop)."""
    cfg = tk.default_decode_config(128, 256)
    ptx = compile_ptx(
        tk._decode_split_kernel,
        decode_constexprs(cfg, fp8=False),
        cfg.num_warps, cfg.num_stages,
    )
    waits = {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}
    assert 2 * (cfg.num_stages - 2) in waits, f"K/V copies are not kept in flight: wait_group {sorted(waits)}"


# ----------------------------------------------------------------------------------------------------
# FP8 cache (kv_cache_dtype = "fp8")
# ----------------------------------------------------------------------------------------------------

# e4m3 -> 16-bit conversions (Hopper converts pairs: cvt.rn.f16x2.e4m3x2) and float32 -> e4m3 (the store)
CVT_FROM_E4M3 = r"cvt\.rn\.f16x2\.e4m3x2"
CVT_TO_E4M3 = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
CP_ASYNC_ANY = r"cp\.async\.c[ag]\.shared\.global"


def test_fp8_store_kernel_compiles_for_sm90() -> None:
    """The store writes bytes it assembles itself (an FP8 cache is passed as byte views, ``store_kv``): no hardware
    float-to-e4m3 conversion, which writes -0 as +0 on an H200."""
    ptx = compile_ptx(tk._store_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P2=8, DIM_P2=128,
                                                BLOCK_SIZE=256, KV_FP8=True), 4, 1, fp8=True,
                      byte_caches=True)  # fmt: skip
    assert count(CVT_TO_E4M3, ptx) == 0, "the e4m3 bytes are built from the bits, not converted"
    assert count(r"div\.rn\.f32", ptx) > 0, "scale and scaled values use IEEE division, as PyTorch does"


@pytest.mark.parametrize("group", [32, 4], ids=["four-warp-tile", "one-warp-tile"])
def test_fp8_decode_kernel_compiles_for_sm90(group: int) -> None:
    """Both FP8 default tiles: 64 keys and 4 warps (32 query heads a KV head), 32 keys and one warp (four)."""
    cfg = tk.default_decode_config(128, 256, fp8=True, group=group)
    assert cfg.num_warps == (1 if group == 4 else 4)
    ptx = compile_ptx(
        tk._decode_split_kernel,
        decode_constexprs(cfg, fp8=True),
        cfg.num_warps, cfg.num_stages, fp8=True,
    )
    assert count(CVT_FROM_E4M3, ptx) > 0
    assert count(CP_ASYNC_ANY, ptx) > 0, "the e4m3 K/V tiles should stream through cp.async"
    assert count(r"mma\.sync\S*\.f16\.f16", ptx) > 0, "both dots run in float16"
    assert count(r"mma\.sync\S*\.bf16", ptx) == 0
    # e4m3 -> f16x2 is the only conversion of a K/V value: none on to bfloat16 or float32 (float32 -> bf16x2
    # packs remain: the output's, written directly or merged in the kernel)
    assert count(r"cvt\.bf16\.f16|cvt\.f32\.f16", ptx) == 0
    # four copy groups per tile (keys, their scales, values, theirs) stay in flight across iterations
    waits = {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}
    assert 4 * (cfg.num_stages - 2) in waits, f"K/V copies are not kept in flight: wait_group {sorted(waits)}"


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_fp8_prefill_kernel_compiles_for_sm90(use_tma: bool) -> None:
    cfg = tk.PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, use_tma=use_tma)
    desc = f"tensordesc<fp8e4nv[{cfg.block_n}, 128]>"
    ptx = compile_ptx(tk._prefill_kernel, prefill_constexprs(cfg, use_tma, fp8=True), cfg.num_warps, cfg.num_stages,
                      descriptors={"KEY_CACHE": desc, "VALUE_CACHE": desc} if use_tma else None, fp8=True)
    assert count(CVT_FROM_E4M3, ptx) > 0
    if use_tma:
        assert count(r"cp\.async\.bulk\.tensor\.2d", ptx) >= 4
    assert count(r"wgmma\.mma_async", ptx) > 0
    assert count(r"wgmma\.mma_async\S*\.bf16", ptx) == 0, "both dots run in float16"
    # to bfloat16 only once: the output tile, two values a conversion over the program's threads
    output_cvts = cfg.block_m * 128 // (2 * 32 * cfg.num_warps)
    assert count(r"cvt\.bf16\.f16|cvt\.f32\.f16|cvt\.rn\.bf16x2\.f32", ptx) == output_cvts
