"""The FP8 kernels compile for Hopper (sm_90) without a GPU, and use the intended instructions.

Triton's interpreter (``test_kernels.py``) checks the arithmetic but accepts code the compiler would reject, and
cannot say which instructions run; this compiles each kernel ahead of time for ``cuda:90`` with the launches'
tiles (arguments specialised as the JIT does for 16-aligned pointers and strides) and reads the PTX: the block
GEMM multiplies e4m3 with Hopper's ``wgmma`` (a decode batch's tiles swapped to get there), the weight-only
kernel's tensor-core path multiplies bfloat16, and the quantization assembles its bytes itself.
"""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")

from nanovllm_quant_fp8 import kernels as qk  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # pragma: no cover - another Triton layout
    pytest.skip(f"Triton's ahead-of-time compile API is not available: {exc}", allow_module_level=True)

# pointer parameters of the three kernels, as a bfloat16 model launches them
POINTERS = {
    "X": "*bf16", "XQ": "*u8", "S": "*fp32",  # quantization (and the weight-only kernel's X and S)
    "A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*bf16", "AS": "*fp32", "BS": "*fp32", "BIAS": "*bf16",  # block GEMM
    "W": "*fp8e4nv", "Y": "*bf16", "RES": "*bf16", "NW": "*bf16", "RES_OUT": "*bf16",  # weight-only
}  # fmt: skip


UNFUSED = dict(NORM=False, HAS_RESIDUAL=False, SILU_MUL=False)  # the weight-only kernel's product alone
W8A16_SCALARS = {"eps": "fp32"}


def compile_ptx(fn, constexprs: dict, num_warps: int, num_stages: int, pointers: dict | None = None) -> str:
    """PTX of ``fn`` for sm_90; ``pointers`` overrides :data:`POINTERS`' types."""
    types = {**POINTERS, **(pointers or {})}
    signature, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
            if types[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(JITFunction(fn), signature, constexprs, attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    return kernel.asm["ptx"]


def count(pattern: str, ptx: str) -> int:
    return len(re.findall(pattern, ptx))


def launch_constexprs(cfg: dict) -> tuple[dict, int, int]:
    """A launch config split into the kernel's constexprs and its warps and stages."""
    cfg = dict(cfg)
    return cfg, cfg.pop("num_warps"), cfg.pop("num_stages")


E4M3_WGMMA = r"wgmma\.mma_async\S*\.e4m3\.e4m3"


@pytest.mark.parametrize("rows", [8192, 2048, 256, 128, 64, 32, 16, 1])
def test_block_gemm_multiplies_e4m3_with_wgmma(rows: int) -> None:
    """Every tile of :func:`w8a8_block_config` multiplies e4m3 with Hopper's ``wgmma``, a decode batch's swapped
    tiles too; none converts its operands (Triton's fallback for tiles of fewer than 64 rows: float16 ``mma``)."""
    constexprs, num_warps, num_stages = launch_constexprs(qk.w8a8_block_config(rows, 4096, 4096, 128))
    constexprs.update(SCALE_N=128, SCALE_K=128, EVEN_K=True, HAS_BIAS=False, PDL=False)
    ptx = compile_ptx(qk._w8a8_block_kernel, constexprs, num_warps, num_stages)
    assert count(E4M3_WGMMA, ptx) > 0, "the block GEMM should multiply e4m3 operands with wgmma"
    assert count(r"mma\.sync", ptx) == 0
    assert count(r"cvt\S*\.e4m3x2", ptx) == 0, "no operand should be converted out of e4m3"


def test_block_gemm_compiles_with_bias_and_ragged_k() -> None:
    for rows in (300, 3):
        constexprs, num_warps, num_stages = launch_constexprs(qk.w8a8_block_config(rows, 4096, 4000, 128))
        constexprs.update(SCALE_N=128, SCALE_K=128, EVEN_K=False, HAS_BIAS=True, PDL=False)
        ptx = compile_ptx(qk._w8a8_block_kernel, constexprs, num_warps, num_stages)
        assert count(E4M3_WGMMA, ptx) > 0


@pytest.mark.parametrize("late_sum", [False, True], ids=["chunk-sums", "late-sum"])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_weight_only_kernel_compiles(rows: int, block: tuple[int, int] | None, late_sum: bool) -> None:
    """The few-row kernel: e4m3 weights converted in pairs; from five rows on, bfloat16 tensor-core products;
    ``LATE_SUM`` (CUDA cores only) compiles too."""
    cfg = qk.w8a16_config(rows, 4096, 4096, block)
    if cfg["USE_DOT"] and late_sum:
        pytest.skip("LATE_SUM is the CUDA cores' path")
    cfg["LATE_SUM"] = late_sum
    constexprs, num_warps, num_stages = launch_constexprs(cfg)
    constexprs.update(SCALE_N=1 if block is None else block[0], SCALE_K=4096 if block is None else block[1],
                      BLOCKWISE=block is not None, EVEN_K=True, HAS_BIAS=False, PDL=False, **UNFUSED)  # fmt: skip
    ptx = compile_ptx(qk._w8a16_kernel, constexprs, num_warps, num_stages, W8A16_SCALARS)
    assert count(r"ld\.global", ptx) > 0
    if cfg["USE_DOT"]:
        assert count(r"mma\S*\.bf16", ptx) > 0, "five rows and more use bfloat16 tensor-core products"
    else:
        assert count(r"mma", ptx) == 0


@pytest.mark.parametrize("group", [None, 128])
def test_quantization_builds_its_bytes(group: int | None) -> None:
    """No float-to-e4m3 conversion (the bytes are assembled from the rounded values' bits), IEEE division by the
    scale, and byte stores."""
    constexprs = (
        dict(GROUP=4096, BLOCK_G=1, BLOCK_C=4096, PER_TOKEN=True)
        if group is None
        else dict(GROUP=group, BLOCK_G=16, BLOCK_C=group, PER_TOKEN=False)
    )
    constexprs.update(RECIPROCAL=True, PDL=False)
    ptx = compile_ptx(qk._quantize_kernel, constexprs, 4, 1)
    assert count(r"cvt\S*\.e4m3", ptx) == 0
    assert count(r"div\.rn\.f32", ptx) > 0
    assert count(r"st\.global\S*\.(u8|b8|v\d\.b8)", ptx) + count(r"st\.global\S*\.b16", ptx) > 0


def loop_body(ptx: str) -> str:
    """The PTX of the first loop: from a block's label to the branch back to it."""
    for label in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        back = re.search(rf"\bbra(\.uni)?\s+{re.escape(label.group(1))};", ptx[label.end() :])
        if back:
            return ptx[label.end() : label.end() + back.start()]
    raise AssertionError("no loop in the kernel")


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_late_sum_loop_only_loads_and_multiplies(block: tuple[int, int] | None, rows: int) -> None:
    """``LATE_SUM``: the loop over K streams the weight (its loads, conversions and FMAs); no cross-thread shuffle
    inside it (the sums across threads come once, after it), and with one row no barrier either."""
    cfg = dict(qk.w8a16_config(rows, 4096, 4096, block), LATE_SUM=True)
    constexprs, num_warps, num_stages = launch_constexprs(cfg)
    constexprs.update(SCALE_N=1 if block is None else block[0], SCALE_K=4096 if block is None else block[1],
                      BLOCKWISE=block is not None, EVEN_K=True, HAS_BIAS=False, PDL=False, **UNFUSED)  # fmt: skip
    body = loop_body(compile_ptx(qk._w8a16_kernel, constexprs, num_warps, num_stages, W8A16_SCALARS))
    assert count(r"ld\.global\.v4", body) > 0
    assert count(r"shfl\.sync", body) == 0
    assert rows > 1 or count(r"bar\.sync", body) == 0


@pytest.mark.parametrize("fusion", ["norm", "add-norm", "silu-mul", "add-norm-silu-mul"])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_weight_only_kernel_compiles_with_its_neighbours(block: tuple[int, int] | None, rows: int, fusion: str) -> None:
    """The norm before the product and the SiLU-and-mul after it compile into each of its paths; on the CUDA
    cores' path (``LATE_SUM``) the loop still has no cross-thread shuffle (the rows' squares are summed across
    threads once, after it), and with one row no barrier."""
    silu_mul = fusion.endswith("silu-mul")
    cfg = qk.w8a16_config(rows, 12288, 4096, block, silu_mul)
    constexprs, num_warps, num_stages = launch_constexprs(cfg)
    constexprs.update(SCALE_N=1 if block is None else block[0], SCALE_K=4096 if block is None else block[1],
                      BLOCKWISE=block is not None, EVEN_K=True, HAS_BIAS=False, PDL=False, SILU_MUL=silu_mul,
                      NORM=fusion != "silu-mul", HAS_RESIDUAL=fusion.startswith("add"))  # fmt: skip
    ptx = compile_ptx(qk._w8a16_kernel, constexprs, num_warps, num_stages, W8A16_SCALARS)
    assert (count(r"rsqrt\.approx", ptx) > 0) is constexprs["NORM"]
    assert (count(r"ex2\.approx", ptx) > 0) is silu_mul
    if cfg["USE_DOT"]:
        assert count(r"mma\S*\.bf16", ptx) > 0
        return
    body = loop_body(ptx)
    assert count(r"ld\.global", body) > 0
    assert count(r"shfl\.sync", body) == 0
    assert rows > 1 or count(r"bar\.sync", body) == 0
