"""The FP8 kernels (``nanovllm_quant_fp8.kernels``) against their contract, ``nanovllm_quant_fp8.fp8``.

On the CPU the kernels run in Triton's interpreter, on small odd shapes (``K`` not a multiple of the scale block,
``N`` not a multiple of the tiles, a handful of rows): the activation quantization bit for bit, the GEMMs up to
the order of their float32 sums. The interpreter handles e4m3 tensors (loads, conversions, e4m3 dots) but
multiplies bfloat16 dot operands as their raw bits, so the weight-only kernel's tensor-core path is checked
there with float16 rows only; its bfloat16 path runs on CUDA, in the GPU tests.

The GPU tests (``gpu``) run each kernel on Qwen3-8B's projection shapes against the same references and print
timings beside bfloat16 ``F.linear`` and ``torch._scaled_mm`` with row-wise scales.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from nanovllm_quant_fp8 import fp8  # noqa: E402
from nanovllm_quant_fp8 import kernels as qk  # noqa: E402
from nanovllm_testing import cuda_median_ms  # noqa: E402

# tests/conftest.py skips ``gpu`` tests without CUDA for the core's tests only: the plugin's skip themselves too
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rows_of(m: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``[m, k]`` values spanning many magnitudes (columns from 1e-6 to 1e3), so that every e4m3 exponent,
    subnormals included, turns up after scaling."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, k)[torch.randperm(k, generator=g)]
    return x.to(device=device, dtype=dtype)


def assert_same_quantization(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    xq, scale = got
    rq, rscale = want
    assert xq.dtype == fp8.FP8_DTYPE and xq.is_contiguous() and xq.shape == rq.shape
    assert scale.dtype == torch.float32 and scale.shape == rscale.shape
    assert torch.equal(scale, rscale)
    bad = xq.view(torch.uint8) != rq.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} e4m3 bytes differ, first at {bad.nonzero()[0].tolist()}"


def assert_close_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of float32 sums: a float32 result to a relative ``1e-5`` of the largest value,
    a 16-bit one to one unit in the last place of its largest value (the sums may round either side)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    tol = 1e-5 * scale if want.dtype == torch.float32 else torch.finfo(want.dtype).eps * scale
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max error {err} over {tol}"


# ----------------------------------------------------------------------------------------------------
# Activation quantization (interpreter)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("m", "k", "group"),
    [(1, 256, None), (3, 300, None), (2, 5000, None), (3, 300, 128), (17, 200, 64), (2, 130, 96), (1, 100, 128)],
)
def test_quantize_activation_matches_contract(dtype: torch.dtype, m: int, k: int, group: int | None) -> None:
    x = rows_of(m, k, dtype)
    x[0, :5] = torch.tensor([-1e-30, -0.0, 0.0, 1e-30, -3.0]).to(dtype)  # signed zeros stay signed
    assert_same_quantization(qk.quantize_activation(x, group), fp8.quantize_activation(x, group))


@pytest.mark.parametrize("group", [None, 64])
def test_quantize_activation_rounds_ties_to_even(group: int | None) -> None:
    """Every e4m3 value, every midpoint between two (a tie) and the floats either side of each, in rows whose
    largest magnitude is 448 (scale 1): the rounding alone decides each byte."""
    codes = torch.arange(127, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    values = torch.cat([values, -values])
    values = torch.cat([values, values.new_zeros(-values.numel() % 64)]).view(-1, 64)
    values[:, 0] = 448.0
    got = qk.quantize_activation(values, group)
    assert torch.equal(got[1], torch.ones_like(got[1]))
    assert_same_quantization(got, fp8.quantize_activation(values, group))


def test_quantize_activation_zero_rows_and_leading_shape() -> None:
    """An all-zero row or group gets the smallest scale and zeros; ``x`` of any leading shape keeps it."""
    x = rows_of(6, 160, torch.bfloat16).view(2, 3, 160)
    x[1, 2] = 0.0
    x[0, 1, :128] = 0.0
    for group in (None, 128):
        xq, scale = qk.quantize_activation(x, group)
        assert xq.shape == x.shape and scale.shape == (2, 3, 1 if group is None else 2)
        assert_same_quantization((xq.view(6, 160), scale.view(6, -1)), fp8.quantize_activation(x.view(6, 160), group))
        assert scale[1, 2].eq(fp8.MIN_SCALE).all() and xq[1, 2].float().eq(0).all()


def test_quantize_activation_takes_strided_rows() -> None:
    x = rows_of(4, 512, torch.bfloat16)[:, :300]
    assert_same_quantization(qk.quantize_activation(x, 128), fp8.quantize_activation(x, 128))


# ----------------------------------------------------------------------------------------------------
# W8A8 block GEMM (interpreter)
# ----------------------------------------------------------------------------------------------------


def block_case(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    bias = torch.randn(n, generator=g).to(dtype)
    wq, w_scale = fp8.quantize_weight_blockwise(w, block)
    return x, wq, w_scale, bias


@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (1, 64, 256, (128, 128)),
        (3, 200, 300, (128, 128)),
        (17, 130, 256, (64, 128)),
        (5, 96, 160, (32, 64)),
        (40, 72, 200, (128, 128)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_block_matmul_matches_reference(m: int, n: int, k: int, block: tuple[int, int], dtype) -> None:
    x, wq, w_scale, bias = block_case(m, n, k, block, dtype)
    for b in (None, bias):
        xq, x_scale = qk.quantize_activation(x, block[1])
        got = qk.w8a8_block_matmul(xq, x_scale, wq, w_scale, block, dtype, b)
        assert_close_product(got, fp8.w8a8_reference(x, wq, w_scale, block, b))


@pytest.mark.parametrize("swap", [False, True], ids=["rows-by-columns", "swapped"])
def test_w8a8_block_matmul_small_tiles(swap: bool) -> None:
    """Several tiles each way (the grouped tile order, rows and columns wrapped around past ``M`` and ``N``),
    two ``BLOCK_K`` steps per scale block, ``K`` cut short, both tile orientations."""
    x, wq, w_scale, bias = block_case(40, 100, 300, (128, 128), torch.float32, seed=1)
    xq, x_scale = qk.quantize_activation(x.view(2, 20, 300), 128)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "SWAP_AB": swap, "num_warps": 4,
           "num_stages": 2}  # fmt: skip
    got = qk.w8a8_block_matmul(xq, x_scale, wq, w_scale, (128, 128), torch.float32, bias, config=cfg)
    assert got.shape == (2, 20, 100)
    assert_close_product(got.view(40, 100), fp8.w8a8_reference(x, wq, w_scale, (128, 128), bias))


def test_w8a8_block_matmul_rejects_mismatched_scales() -> None:
    x, wq, w_scale, _ = block_case(2, 64, 256, (128, 128), torch.bfloat16)
    xq, x_scale = qk.quantize_activation(x, 128)
    with pytest.raises(ValueError, match="w_scale"):
        qk.w8a8_block_matmul(xq, x_scale, wq, w_scale[:, :1], (128, 128), torch.bfloat16)
    with pytest.raises(ValueError, match="x_scale"):
        qk.w8a8_block_matmul(xq, x_scale[:, :1], wq, w_scale, (128, 128), torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# W8A16 few-row GEMM (interpreter)
# ----------------------------------------------------------------------------------------------------


def weight_case(n: int, k: int, block: tuple[int, int] | None, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(device)
    return fp8.quantize_weight_per_channel(w) if block is None else fp8.quantize_weight_blockwise(w, block)


@pytest.mark.parametrize("block", [None, (128, 128), (64, 64)], ids=["per-channel", "block128", "block64"])
@pytest.mark.parametrize(("m", "n", "k", "dtype"), [
    (1, 70, 300, torch.bfloat16),  # the CUDA cores' path (a few rows)
    (3, 64, 256, torch.float16),
    (5, 70, 300, torch.float16),  # tensor cores (float16: the interpreter's bfloat16 dots are wrong)
    (16, 40, 128, torch.float16),
])  # fmt: skip
def test_w8a16_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype, block) -> None:
    wq, w_scale = weight_case(n, k, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (None, bias):
        got = qk.w8a16_linear(x, wq, w_scale, block, b)
        assert_close_product(got, fp8.w8a16_reference(x, wq, w_scale, block, b))


def test_w8a16_linear_small_chunks_and_leading_shape() -> None:
    """Narrow column slices and ``BLOCK_K`` steps shorter than the scale block; ``x`` of shape ``[2, 2, K]``."""
    wq, w_scale = weight_case(50, 200, (32, 128))
    x = torch.randn(2, 2, 200, dtype=torch.bfloat16)
    cfg = {"M_PAD": 4, "BLOCK_N": 4, "BLOCK_K": 32, "USE_DOT": False, "num_warps": 2, "num_stages": 1}
    got = qk.w8a16_linear(x, wq, w_scale, (32, 128), config=cfg)
    assert got.shape == (2, 2, 50)
    assert_close_product(got.view(4, 50), fp8.w8a16_reference(x.view(4, 200), wq, w_scale, (32, 128)))


@pytest.mark.parametrize("block", [None, (32, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 3])
def test_w8a16_linear_late_sum_matches_reference(m: int, block) -> None:
    """The CUDA cores' products summed once at the end (``LATE_SUM``), over chunks of a K that is not a multiple of
    ``BLOCK_K``, with and without bias."""
    wq, w_scale = weight_case(50, 300, block)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, 300, generator=g).to(torch.bfloat16)
    bias = torch.randn(50, generator=g).to(torch.bfloat16)
    cfg = dict(qk.w8a16_config(m, 50, 300, block), BLOCK_K=64, LATE_SUM=True)
    for b in (None, bias):
        got = qk.w8a16_linear(x, wq, w_scale, block, b, config=cfg)
        assert_close_product(got, fp8.w8a16_reference(x, wq, w_scale, block, b))


def test_w8a16_sums_late_wherever_the_cuda_cores_sum() -> None:
    """The default launch: ``LATE_SUM`` from one to four rows (the CUDA cores' path), tensor cores after."""
    for m in (1, 2, 3, 4, 5, 8, 16):
        cfg = qk.w8a16_config(m, 4096, 4096, None)
        assert cfg["LATE_SUM"] is (m <= 4) and cfg["USE_DOT"] is (m > 4)
        assert qk.w8a16_config(m, 4096, 4096, (128, 128))["LATE_SUM"] is (m <= 4)


def test_per_token_quantization_of_wide_rows_runs_eight_warps(monkeypatch: pytest.MonkeyPatch) -> None:
    """One program a row: from 2,048 columns its launch has eight warps (four below, and for 1 x 128 groups)."""
    warps = []
    real = qk._quantize

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                warps.append(kwargs["num_warps"])
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(qk, "_quantize", lambda interpret: Recorder(real(interpret)))
    x = torch.randn(2, 4096, dtype=torch.bfloat16)
    for k, group in ((4096, None), (2048, None), (1024, None), (4096, 128)):
        qk.quantize_activation(x[:, :k], group)
    assert warps == [8, 8, 4, 4]


def test_w8a16_late_sum_refuses_tensor_cores() -> None:
    wq, w_scale = weight_case(64, 128, None)
    cfg = dict(qk.w8a16_config(8, 64, 128, None), LATE_SUM=True)
    with pytest.raises(ValueError, match="LATE_SUM"):
        qk.w8a16_linear(torch.randn(8, 128, dtype=torch.bfloat16), wq, w_scale, config=cfg)


def test_w8a16_supports() -> None:
    wq, _ = weight_case(64, 128, None)
    x = torch.randn(qk.MAX_ROWS, 128, dtype=torch.bfloat16)
    assert qk.supports(x, wq) and qk.supports(x[:1].view(1, 1, 128), wq)
    assert not qk.supports(torch.randn(qk.MAX_ROWS + 1, 128, dtype=torch.bfloat16), wq)  # too many rows
    assert not qk.supports(x.float(), wq)  # float32 rows
    assert not qk.supports(x, wq.float())  # not an FP8 weight
    assert not qk.supports(torch.randn(128, 4, dtype=torch.bfloat16).t(), wq)  # a strided last dimension
    assert qk.supports(x[:, :64], wq[:, :64].contiguous())  # strided rows are fine
    assert not qk.supports(x[:, :64].contiguous(), wq)  # other width
    with pytest.raises(ValueError, match="at most"):
        qk.w8a16_linear(torch.randn(qk.MAX_ROWS + 1, 128, dtype=torch.bfloat16), wq, torch.ones(64))


def norm_case(m: int, k: int, dtype: torch.dtype, with_residual: bool, seed: int = 0):
    """Rows, a residual (or None) and a norm weight, as a decode step's RMSNorm takes them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    residual = (torch.randn(m, k, generator=g) * 4).to(dtype) if with_residual else None
    return x, residual, (torch.rand(k, generator=g) + 0.5).to(dtype)


def separate_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor):
    """The core's RMSNorm kernel (its roundings; Triton's interpreter on the CPU): ``(normed, new_residual)``."""
    from nanovllm_core.layers import rms_norm_kernel

    if residual is None:
        return rms_norm_kernel.rms_norm(x, norm_weight, 1e-6), x
    return rms_norm_kernel.rms_norm(x, norm_weight, 1e-6, residual)


def assert_close_to_separate(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """Within ``ulps`` units in the last place of ``want``'s largest value: the fused norm rounds the normalised
    rows once where the separate kernel rounds twice, so a few outputs round the other way."""
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert got.shape == want.shape and err <= ulps * torch.finfo(want.dtype).eps * scale, f"max error {err}"


# (rows, dtype): the CUDA cores' paths in bfloat16, the tensor cores' in float16 (see the module's docstring)
FEW_ROWS = [(1, torch.bfloat16), (3, torch.bfloat16), (5, torch.float16), (16, torch.float16)]


@pytest.mark.parametrize("block", [None, (32, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize(("m", "dtype"), FEW_ROWS)
def test_w8a16_silu_mul_is_the_product_then_the_activation(m: int, dtype: torch.dtype, block) -> None:
    """``silu_mul``: the bytes of the product followed by the core's SiLU-and-mul kernel (the gate and up sums
    are the product's, rounded where the separate kernels round), over a K that is not a multiple of ``BLOCK_K``."""
    from nanovllm_core.layers import silu_and_mul_kernel

    wq, w_scale = weight_case(64, 300, block)
    x = norm_case(m, 300, dtype, False)[0]
    got = qk.w8a16_linear(x, wq, w_scale, block, silu_mul=True)
    assert got.shape == (m, 32)
    assert torch.equal(got, silu_and_mul_kernel.silu_and_mul(qk.w8a16_linear(x, wq, w_scale, block)))


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("block", [None, (32, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize(("m", "dtype"), FEW_ROWS)
def test_w8a16_norm_linear_is_the_norm_then_the_product(m: int, dtype: torch.dtype, block, with_residual) -> None:
    """The residual add and the RMSNorm in the product's launch: the new residual is the core's kernel's, byte
    for byte; the product is the separate norm's then the product's up to the norm's roundings; with
    ``silu_mul`` too, the activation of the fused product, byte for byte."""
    from nanovllm_core.layers import silu_and_mul_kernel

    x, residual, norm_weight = norm_case(m, 300, dtype, with_residual, seed=m)
    normed, summed = separate_norm(x, residual, norm_weight)
    wq, w_scale = weight_case(64, 300, block)
    cfg = dict(qk.w8a16_config(m, 64, 300, block), BLOCK_K=64)  # several chunks, the last one cut short
    y, new_residual = qk.w8a16_norm_linear(x, wq, w_scale, block, norm_weight, 1e-6, residual, config=cfg)
    assert torch.equal(new_residual, summed) and (with_residual or new_residual is x)
    assert_close_to_separate(y, qk.w8a16_linear(normed, wq, w_scale, block, config=cfg), ulps=2)
    activated, again = qk.w8a16_norm_linear(x, wq, w_scale, block, norm_weight, 1e-6, residual, silu_mul=True)
    assert torch.equal(again, summed)
    fused_product = qk.w8a16_norm_linear(x, wq, w_scale, block, norm_weight, 1e-6, residual)[0]
    assert torch.equal(activated, silu_and_mul_kernel.silu_and_mul(fused_product))


def test_w8a16_norm_linear_refuses_what_it_cannot_take() -> None:
    wq, w_scale = weight_case(64, 128, None)
    x, residual, norm_weight = norm_case(2, 128, torch.bfloat16, True)
    with pytest.raises(ValueError, match="norm_weight"):
        qk.w8a16_norm_linear(x, wq, w_scale, None, norm_weight[:64], 1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        qk.w8a16_norm_linear(x, wq, w_scale, None, norm_weight.half(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        qk.w8a16_norm_linear(x, wq, w_scale, None, norm_weight, 1e-6, residual[:1])
    with pytest.raises(ValueError, match="even number of rows and no bias"):
        qk.w8a16_linear(x, wq[:63].contiguous(), w_scale[:63], silu_mul=True)
    with pytest.raises(ValueError, match="even number of rows and no bias"):
        qk.w8a16_linear(x, wq, w_scale, bias=torch.zeros(64, dtype=torch.bfloat16), silu_mul=True)


def test_w8a16_silu_mul_reads_as_many_weight_rows_a_program() -> None:
    """With ``silu_mul`` a program of the CUDA cores' path owns half the columns (each read twice: gate and up),
    with per-channel scales; the tensor cores' tiles and the block-scaled launches keep their width."""
    for m in (1, 3, 8):
        for block in (None, (128, 128)):
            plain = qk.w8a16_config(m, 4096, 4096, block)
            fused = qk.w8a16_config(m, 4096, 4096, block, silu_mul=True)
            halved = block is None and not plain["USE_DOT"]
            assert fused == dict(plain, BLOCK_N=plain["BLOCK_N"] // (2 if halved else 1))


# ----------------------------------------------------------------------------------------------------
# CUDA: Qwen3-8B shapes, against the references, with timings
# ----------------------------------------------------------------------------------------------------

QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate-up, down
ROWS = [1, 4, 16, 64, 256, 2048]


def median_us(fn, reps: int = 25) -> float:
    """Median time of ``fn`` in microseconds, each repetition timed by its own CUDA events after the L2 cache
    was overwritten (a decode step reads its weights from memory, not from the cache)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return cuda_median_ms(fn, reps, before=flush.zero_) * 1000


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_quantize_activation_matches_contract(dtype: torch.dtype, group: int | None) -> None:
    """Bit for bit on CUDA too, where PyTorch rounds the scale differently (``kernels._quantize_kernel``)."""
    x = rows_of(300, 5000, dtype, device="cuda")
    x[0, :4] = torch.tensor([-1e-30, -0.0, 0.0, 1e-30], device="cuda").to(dtype)
    assert_same_quantization(qk.quantize_activation(x, group), fp8.quantize_activation(x, group))


def check_and_time(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int]) -> dict[str, float]:
    """Each kernel's result on ``x`` against its reference, then the median times (microseconds) of: ``F.linear``
    in bfloat16; ``torch._scaled_mm`` with row-wise scales (per-token activation, per-channel weight), alone and
    after the activation's quantization; the block GEMM, alone and after the quantization; the weight-only
    kernel with block and with per-channel scales (``MAX_ROWS`` rows at most)."""
    bq, bs = fp8.quantize_weight_blockwise(w, block)
    cq, cs = fp8.quantize_weight_per_channel(w)
    xq, x_scale = qk.quantize_activation(x, block[1])
    assert_close_product(
        qk.w8a8_block_matmul(xq, x_scale, bq, bs, block, x.dtype), fp8.w8a8_reference(x, bq, bs, block)
    )
    tq, ts = qk.quantize_activation(x, None)

    def row_wise(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(xq, cq.t(), scale_a=scale, scale_b=cs.view(1, -1), out_dtype=x.dtype)

    nan = float("nan")
    times = {"bf16": median_us(lambda: F.linear(x, w))}
    try:
        scaled = row_wise(tq, ts)
    except RuntimeError:  # a PyTorch or GPU without row-wise scaled_mm
        times["scaled_mm"] = times["scaled_mm+quant"] = nan
    else:
        assert_close_product(scaled, fp8.w8a8_reference(x, cq, cs))
        times["scaled_mm"] = median_us(lambda: row_wise(tq, ts))
        times["scaled_mm+quant"] = median_us(lambda: row_wise(*qk.quantize_activation(x, None)))
    times["w8a8"] = median_us(lambda: qk.w8a8_block_matmul(xq, x_scale, bq, bs, block, x.dtype))
    times["w8a8+quant"] = median_us(
        lambda: qk.w8a8_block_matmul(*qk.quantize_activation(x, block[1]), bq, bs, block, x.dtype)
    )
    times["w8a16 block"] = times["w8a16 channel"] = nan
    if qk.supports(x, bq):
        assert_close_product(qk.w8a16_linear(x, bq, bs, block), fp8.w8a16_reference(x, bq, bs, block))
        assert_close_product(qk.w8a16_linear(x, cq, cs), fp8.w8a16_reference(x, cq, cs))
        times["w8a16 block"] = median_us(lambda: qk.w8a16_linear(x, bq, bs, block))
        times["w8a16 channel"] = median_us(lambda: qk.w8a16_linear(x, cq, cs))
    return times


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernels_on_qwen3_8b_shapes() -> None:
    """Every kernel on every (shape, rows) of :data:`QWEN3_8B` and :data:`ROWS`: checked, then timed."""
    torch.manual_seed(0)
    columns = ["bf16", "scaled_mm", "scaled_mm+quant", "w8a8", "w8a8+quant", "w8a16 block", "w8a16 channel"]
    print("\nmedian microseconds\n     N      K      M " + " ".join(f"{c:>15}" for c in columns))
    for n, k in QWEN3_8B:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in ROWS:
            times = check_and_time(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w, (128, 128))
            print(f"{n:6d} {k:6d} {m:6d} " + " ".join(f"{times[c]:15.1f}" for c in columns), flush=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
def test_gpu_w8a16_with_its_neighbours_against_the_separate_kernels(rows: int, block) -> None:
    """On Qwen3-8B's widths, a decode step's few rows: the residual add and RMSNorm before the q/k/v product, and
    the SiLU-and-mul after gate-up's, in the weight-only kernel's launch, against the core's kernels around the
    product (``benchmarks/decode_gemm.py --fp8 --norm`` times both ways)."""
    from nanovllm_core.layers import rms_norm_kernel, silu_and_mul_kernel

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, 4096, generator=g, device="cuda", dtype=torch.bfloat16) * 8
    norm_weight = torch.rand(4096, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    normed, summed = rms_norm_kernel.rms_norm(x, norm_weight, 1e-6, residual)
    wq, w_scale = weight_case(6144, 4096, block, seed=1, device="cuda")  # q/k/v
    y, new_residual = qk.w8a16_norm_linear(x, wq, w_scale, block, norm_weight, 1e-6, residual)
    assert torch.equal(new_residual, summed)
    assert_close_to_separate(y, qk.w8a16_linear(normed, wq, w_scale, block), ulps=2)
    wq, w_scale = weight_case(24576, 4096, block, seed=2, device="cuda")  # gate-up
    want = silu_and_mul_kernel.silu_and_mul(qk.w8a16_linear(normed, wq, w_scale, block))
    assert_close_to_separate(qk.w8a16_linear(normed, wq, w_scale, block, silu_mul=True), want, ulps=2)
