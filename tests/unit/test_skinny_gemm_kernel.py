"""The Triton kernel for a few rows (``skinny_gemm_kernel``) against ``F.linear``.

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

from nanovllm_core.layers.fused import set_compile  # noqa: E402
from nanovllm_core.layers.linear import ReplicatedLinear  # noqa: E402
from nanovllm_core.layers.skinny_gemm_kernel import (  # noqa: E402
    MAX_ROWS,
    MAX_WEIGHT_ELEMENTS,
    launch_config,
    skinny_linear,
    supports,
)


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
