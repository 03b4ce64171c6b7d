"""The Triton kernel for a few rows (``skinny_gemm_kernel``) against ``F.linear``, and its RMSNorm prologue
against ``rms_norm_kernel`` followed by the plain kernel.

On CPU the kernel runs in Triton's interpreter: float32 must agree to summation-order noise. On CUDA the compiled
kernel is compared with cuBLAS's bf16 ``F.linear`` at Qwen3-0.6B's and 8B's decode projections (both accumulate
in float32 and round once, so they differ by at most one bf16 rounding of the output), and the linear layers take
it for a decode batch with fusion on and keep ``F.linear`` otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from nanovllm_core.layers import RMSNorm  # noqa: E402
from nanovllm_core.layers.fused import set_compile  # noqa: E402
from nanovllm_core.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    norm_linear,
)
from nanovllm_core.layers.rms_norm_kernel import rms_norm  # noqa: E402
from nanovllm_core.layers.skinny_gemm_kernel import (  # noqa: E402
    MAX_ROWS,
    MAX_WEIGHT_ELEMENTS,
    launch_config,
    skinny_linear,
    skinny_norm_linear,
    supports,
)

EPS = 1e-6


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (0.05 * torch.randn(n, k, generator=gen)).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("rows,k,n", [(1, 128, 64), (3, 256, 96), (4, 64, 48), (3, 70, 33), (2, 384, 17)])
def test_float32_matches_f_linear(rows, k, n):
    x, w = _inputs(rows, k, n, torch.float32)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_any_block_configuration_gives_the_same_product():
    x, w = _inputs(3, 96, 40, torch.float32)
    ref = F.linear(x, w)
    for block_n, block_k in ((1, 32), (4, 64), (16, 128)):
        config = {"M_PAD": 4, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 2}
        torch.testing.assert_close(skinny_linear(x, w, config=config), ref, atol=1e-5, rtol=1e-5)


def test_keeps_leading_dims_and_rejects_what_it_cannot_take():
    x, w = _inputs(4, 32, 24, torch.float32)
    out = skinny_linear(x.view(2, 2, 32), w)
    assert out.shape == (2, 2, 24)
    torch.testing.assert_close(out.view(4, 24), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="x has 31 features, the weight takes 32"):
        skinny_linear(torch.zeros(1, 31), w)
    assert supports(torch.zeros(MAX_ROWS, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not supports(torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not supports(torch.zeros(1, 8), torch.zeros(4, 8))  # float32: cuBLAS
    big = torch.empty(MAX_WEIGHT_ELEMENTS // 1024 + 1, 1024, dtype=torch.bfloat16)
    assert not supports(torch.zeros(1, 1024, dtype=torch.bfloat16), big)  # a large matrix: cuBLAS reads it fast
    assert not supports(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16).t())


def test_launch_config_covers_the_rows_and_never_outgrows_k():
    for rows in range(1, MAX_ROWS + 1):
        for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (64, 48)):
            config = launch_config(rows, n, k)
            assert rows <= config["M_PAD"] < 2 * rows
            assert config["BLOCK_K"] < 2 * k


def test_linear_layers_keep_f_linear_off_cuda():
    x, w = _inputs(2, 32, 16, torch.float32)
    layer = ReplicatedLinear(32, 16, bias=False)
    layer.weight.data.copy_(w)
    set_compile(True)
    try:
        assert torch.equal(layer(x), F.linear(x, w))
    finally:
        set_compile(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (4096, 6144), (12288, 4096)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_cuda_matches_cublas(rows, k, n):
    x, w = _inputs(rows, k, n, torch.bfloat16, device="cuda")
    out, ref = skinny_linear(x, w).float(), F.linear(x, w).float()
    exact = F.linear(x.float(), w.float())
    # both round a float32 sum once: within a bf16 rounding of the float32 product, plus the float32 sum's own
    # order-dependent error, which shows on outputs that cancel to near zero
    tolerance = 2.0**-8 * exact.abs() + 1e-5 * exact.abs().max()
    assert torch.all((out - exact).abs() <= tolerance)
    assert torch.all((ref - exact).abs() <= tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_layers_take_the_kernel_for_a_decode_batch_on_cuda():
    layer = ReplicatedLinear(1024, 512, bias=False).to("cuda", torch.bfloat16)
    few, many = torch.randn(MAX_ROWS, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(64, 1024, device="cuda")
    set_compile(True)
    try:
        assert torch.equal(layer(few), skinny_linear(few, layer.weight))
        assert torch.equal(layer(many.bfloat16()), F.linear(many.bfloat16(), layer.weight))
    finally:
        set_compile(False)
    assert torch.equal(layer(few), F.linear(few, layer.weight))


def _silu_and_mul_of_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused path: the product rounded to its dtype, then ``F.silu(gate) * up`` as eager PyTorch rounds it."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


@pytest.mark.parametrize("rows,k,n", [(1, 128, 64), (3, 96, 40), (4, 70, 34)])
def test_silu_mul_matches_the_product_then_silu_and_mul(rows, k, n):
    x, w = _inputs(rows, k, n, torch.float32)
    torch.testing.assert_close(skinny_linear(x, w, silu_mul=True), _silu_and_mul_of_product(x, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="even number of rows, got 5"):
        skinny_linear(x, w[:5], silu_mul=True)


def test_merged_projection_silu_and_mul_is_the_projection_then_the_activation():
    from nanovllm_core.layers import MergedColumnParallelLinear, SiluAndMul

    layer = MergedColumnParallelLinear(32, [24, 24])
    torch.nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(3, 32)
    assert torch.equal(layer.silu_and_mul(x), SiluAndMul()(layer(x)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_cuda_silu_mul_matches_the_separate_kernels(rows):
    from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul

    x, w = _inputs(rows, 1024, 6144, torch.bfloat16, device="cuda")
    fused = skinny_linear(x, w, silu_mul=True)
    separate = silu_and_mul(skinny_linear(x, w))
    # the same sums and roundings; the exponential may differ in its last float32 bit between two kernels
    assert (fused.float() - separate.float()).abs().max() <= 2.0**-7 * separate.float().abs().max()
    assert (fused != separate).float().mean() < 1e-2


def _norm_inputs(rows: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    """Hidden rows, a residual, an RMSNorm weight and a projection, as a decoder layer has them."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device)
    residual = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device)
    norm_weight = (0.5 + torch.rand(k, generator=gen)).to(dtype).to(device)
    w = (0.05 * torch.randn(n, k, generator=gen)).to(dtype).to(device)
    return x, residual, norm_weight, w


def _norm_then_skinny(x, w, norm_weight, residual, silu_mul, config=None):
    """The unfused path: ``rms_norm_kernel.rms_norm`` (with the residual add), then the projection."""
    if residual is None:
        return skinny_linear(rms_norm(x, norm_weight, EPS), w, config=config, silu_mul=silu_mul), x
    h, new_residual = rms_norm(x, norm_weight, EPS, residual)
    return skinny_linear(h, w, config=config, silu_mul=silu_mul), new_residual


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (2, 70, 34), (3, 128, 18), (4, 100, 40)])
def test_norm_prologue_gives_the_bits_of_rms_norm_then_skinny_linear(rows, k, n, with_residual, silu_mul):
    # bfloat16, the default blocks: one chunk of K as wide as rms_norm's block, so the same squares are summed
    # the same way and every rounding is the separate kernels' (K 70 and 100 take the masked path)
    x, residual, norm_weight, w = _norm_inputs(rows, k, n, torch.bfloat16)
    residual = residual if with_residual else None
    y, new_residual = skinny_norm_linear(x, w, norm_weight, EPS, residual, silu_mul=silu_mul)
    ref, ref_residual = _norm_then_skinny(x, w, norm_weight, residual, silu_mul)
    assert y.shape == ref.shape and torch.equal(y, ref)
    if residual is None:
        assert new_residual is x
    else:
        assert torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(new_residual.float(), x.float() + residual.float(), atol=0, rtol=2.0**-7)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_norm_prologue_over_several_chunks_of_k(silu_mul):
    # K over four chunks of 32 (the last one partial): the mean of squares is summed chunk by chunk, in another
    # order than rms_norm's one block. float32 carries that summation-order noise to the output; nothing else
    # differs (bfloat16's roundings would hide it, or flip a rounding of one normalised element in rare cases)
    x, residual, norm_weight, w = _norm_inputs(3, 100, 24, torch.float32)
    config = {"M_PAD": 4, "BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 2}
    y, new_residual = skinny_norm_linear(x, w, norm_weight, EPS, residual, silu_mul=silu_mul, config=config)
    ref, ref_residual = _norm_then_skinny(x, w, norm_weight, residual, silu_mul, config=config)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(new_residual, x + residual) and torch.equal(ref_residual, x + residual)


def test_norm_prologue_keeps_leading_dims_and_rejects_what_it_cannot_take():
    x, residual, norm_weight, w = _norm_inputs(4, 32, 8, torch.float32)
    y, new_residual = skinny_norm_linear(x.view(2, 2, 32), w, norm_weight, EPS, residual.view(2, 2, 32))
    ref, _ = _norm_then_skinny(x, w, norm_weight, residual, False)
    assert y.shape == (2, 2, 8) and new_residual.shape == (2, 2, 32)
    torch.testing.assert_close(y.view(4, 8), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"norm_weight must be a contiguous \(32,\) tensor of torch.float32, got"):
        skinny_norm_linear(x, w, norm_weight[:16], EPS)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(4, 32\) and dtype torch.float32"):
        skinny_norm_linear(x, w, norm_weight, EPS, residual[:2])
    with pytest.raises(ValueError, match="at least one output row, got 0"):
        skinny_norm_linear(x, w[:0], norm_weight, EPS)


def _decoder_modules(hidden: int, inter: int, dtype: torch.dtype, device: str):
    """An RMSNorm, a q/k/v projection and a ``[gate, up]`` projection with random weights."""
    norm = RMSNorm(hidden, EPS).to(device, dtype)
    qkv = QKVParallelLinear(hidden, 64, 4, 2).to(device, dtype)
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter]).to(device, dtype)
    gen = torch.Generator().manual_seed(hidden)
    for param in (qkv.weight, gate_up.weight):
        param.data.copy_(0.05 * torch.randn(param.shape, generator=gen))
    norm.weight.data.copy_(0.5 + torch.rand(hidden, generator=gen))
    return norm, qkv, gate_up


def test_norm_linear_is_exactly_the_norm_then_the_layer_off_cuda(fusion_on_without_compiling):
    norm, qkv, gate_up = _decoder_modules(32, 24, torch.float32, "cpu")
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    y, new_residual = norm_linear(x, norm, None, qkv)
    assert torch.equal(y, qkv(norm(x))) and new_residual is x
    y, new_residual = norm_linear(x, norm, residual, gate_up, silu_mul=True)
    h, ref_residual = norm(x, residual)
    assert torch.equal(y, gate_up.silu_and_mul(h)) and torch.equal(new_residual, ref_residual)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "k,n,silu_mul", [(1024, 4096, False), (1024, 6144, True), (4096, 6144, False), (4096, 8192, True)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_cuda_norm_prologue_matches_the_separate_kernels(rows, k, n, silu_mul):
    x, residual, norm_weight, w = _norm_inputs(rows, k, n, torch.bfloat16, device="cuda")
    y, new_residual = skinny_norm_linear(x, w, norm_weight, EPS, residual, silu_mul=silu_mul)
    ref, ref_residual = _norm_then_skinny(x, w, norm_weight, residual, silu_mul)
    assert torch.equal(new_residual, ref_residual)
    # the compiled kernels sum the squares in another order (a 2-D tile over 2 warps against one row over 4 or 16),
    # so the float32 rstd may differ in its last bit and flip a normalised element's bf16 rounding now and then;
    # each such flip moves an output by a fraction of a bf16 ulp of its terms
    error, scale = (y.float() - ref.float()).abs().amax(dim=-1), ref.float().abs().amax(dim=-1)
    assert torch.all(error <= 2.0**-7 * scale)
    assert (y != ref).float().mean() < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_linear_takes_the_fused_kernel_for_a_decode_batch_on_cuda():
    norm, qkv, gate_up = _decoder_modules(1024, 3072, torch.bfloat16, "cuda")
    few, residual = torch.randn(2, MAX_ROWS, 1024, device="cuda").bfloat16()
    many = torch.randn(64, 1024, device="cuda").bfloat16()
    biased = ReplicatedLinear(1024, 256, bias=True).to("cuda", torch.bfloat16)
    for param in biased.parameters():  # made with torch.empty: NaNs would make torch.equal false
        param.data.normal_(0, 0.02)
    set_compile(True)
    try:
        fused = skinny_norm_linear(few, gate_up.weight, norm.weight, EPS, residual, silu_mul=True)
        assert all(map(torch.equal, norm_linear(few, norm, residual, gate_up, silu_mul=True), fused))
        qkv_fused = skinny_norm_linear(few, qkv.weight, norm.weight, EPS)[0]
        assert torch.equal(norm_linear(few, norm, None, qkv)[0], qkv_fused)
        # many rows, a bias: the norm, then the layer
        assert torch.equal(norm_linear(many, norm, None, qkv)[0], qkv(norm(many)))
        assert torch.equal(norm_linear(few, norm, residual, biased)[0], biased(norm(few, residual)[0]))
    finally:
        set_compile(False)
