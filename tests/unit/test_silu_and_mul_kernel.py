"""The Triton SiLU-and-mul kernel against eager PyTorch's ``F.silu(gate) * up``.

On CPU the kernel runs in Triton's interpreter. float32 must agree to rounding noise (the exponentials of NumPy
and PyTorch may differ in the last bit). For bfloat16 the interpreter rounds float32 to bfloat16 by truncation
where CUDA and PyTorch round to nearest, so results are compared within two bf16 ulps. On CUDA the compiled
kernel is compared with eager PyTorch at the 8B's decode and prompt shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_core.layers import SiluAndMul  # noqa: E402
from nanovllm_core.layers.fused import set_compile  # noqa: E402
from nanovllm_core.layers.fused import silu_and_mul as eager_silu_and_mul  # noqa: E402
from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul, supports  # noqa: E402


def _eager(x: torch.Tensor) -> torch.Tensor:
    return eager_silu_and_mul.__wrapped__(x)


def _inputs(rows: int, width: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype).to(device)


@pytest.mark.parametrize("rows,width", [(1, 64), (5, 96), (3, 1536), (2, 1030)])
def test_float32_matches_eager(rows, width):
    x = _inputs(rows, width, torch.float32)
    torch.testing.assert_close(silu_and_mul(x), _eager(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,width", [(4, 64), (3, 2100)])
def test_bfloat16_within_two_ulps_of_eager(rows, width):
    x = _inputs(rows, width, torch.bfloat16)
    out, ref = silu_and_mul(x).float(), _eager(x).float()
    assert out.shape == (rows, width)
    assert torch.all((out - ref).abs() <= 2 * 2.0**-7 * ref.abs() + 1e-30)


def test_reads_rows_through_their_stride_and_keeps_leading_dims():
    wide = _inputs(6, 80, torch.float32)  # [6, 160]: take every other row, a strided view
    x = wide[::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(silu_and_mul(x), _eager(x), atol=1e-6, rtol=1e-6)
    x3 = _inputs(6, 32, torch.float32).view(2, 3, 64)
    out = silu_and_mul(x3)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, _eager(x3), atol=1e-6, rtol=1e-6)


def test_no_rows_and_bad_layouts():
    assert silu_and_mul(torch.empty(0, 64)).shape == (0, 32)
    with pytest.raises(ValueError, match="must be even, got 63"):
        silu_and_mul(torch.empty(2, 63))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        silu_and_mul(torch.empty(64, 4).t())
    assert not supports(torch.empty(2, 63)) and not supports(torch.empty(64, 4).t()) and supports(torch.empty(2, 8))


def test_module_keeps_the_eager_path_off_cuda(fusion_on_without_compiling):
    """With fusion on, a CPU tensor takes the PyTorch function (the kernel runs only on CUDA tensors)."""
    x = _inputs(3, 16, torch.float32)
    torch.testing.assert_close(SiluAndMul()(x), _eager(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,width", [(1, 12288), (256, 12288), (14336, 12288), (255, 3072), (7, 1000)])
def test_cuda_matches_eager(rows, width):
    x = _inputs(rows, width, torch.bfloat16, device="cuda")
    out, ref = silu_and_mul(x), _eager(x)
    # the compiled kernel's exponential may differ from PyTorch's in its last float32 bit: one bf16 ulp at most
    diff = (out.float() - ref.float()).abs()
    assert torch.all(diff <= 2.0**-7 * ref.float().abs() + 1e-30)
    assert (diff > 0).float().mean() < 1e-3
    set_compile(True)
    try:
        assert torch.equal(SiluAndMul()(x), out)
    finally:
        set_compile(False)


def test_kernel_modules_load_once_and_a_missing_one_is_none():
    from nanovllm_core.layers import silu_and_mul_kernel
    from nanovllm_core.layers.triton_jit import kernel_module

    assert kernel_module("silu_and_mul_kernel") is silu_and_mul_kernel
    assert kernel_module("no_such_kernel_module") is None
