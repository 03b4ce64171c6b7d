"""The Triton RMSNorm kernel against eager PyTorch's ``rms_norm`` and ``add_rms_norm``.

On CPU the kernel runs in Triton's interpreter. float32 must agree to rounding noise. For bfloat16 the
interpreter rounds float32 to bfloat16 by truncation where CUDA and PyTorch round to nearest, so results are
compared within a few bf16 ulps (the sum is rounded once, then the normalised row, then the product). On CUDA
the compiled kernel is compared with eager PyTorch at the 0.6B's and 8B's widths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_core.layers import RMSNorm  # noqa: E402
from nanovllm_core.layers.fused import add_rms_norm as eager_add_rms_norm  # noqa: E402
from nanovllm_core.layers.fused import rms_norm as eager_rms_norm  # noqa: E402
from nanovllm_core.layers.fused import set_compile  # noqa: E402
from nanovllm_core.layers.rms_norm_kernel import rms_norm, supports  # noqa: E402

EPS = 1e-6


def _inputs(rows: int, width: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype).to(device)
    residual = (3 * torch.randn(rows, width, generator=gen)).to(dtype).to(device)
    weight = (0.5 + torch.rand(width, generator=gen)).to(dtype).to(device)
    return x, residual, weight


def _within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: int) -> bool:
    out, ref = out.float(), ref.float()
    return bool(torch.all((out - ref).abs() <= ulps * 2.0**-7 * ref.abs() + 1e-30))


@pytest.mark.parametrize("rows,width", [(1, 64), (5, 96), (3, 1024)])
def test_float32_matches_eager(rows, width):
    x, residual, weight = _inputs(rows, width, torch.float32)
    torch.testing.assert_close(rms_norm(x, weight, EPS), eager_rms_norm.__wrapped__(x, weight, EPS))
    out, new_residual = rms_norm(x, weight, EPS, residual)
    ref, ref_residual = eager_add_rms_norm.__wrapped__(x, residual, weight, EPS)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(new_residual, ref_residual)


def test_bfloat16_within_a_few_ulps_of_eager():
    x, residual, weight = _inputs(4, 200, torch.bfloat16)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    ref, ref_residual = eager_add_rms_norm.__wrapped__(x, residual, weight, EPS)
    assert _within_ulps(new_residual, ref_residual, 1)
    assert _within_ulps(out, ref, 3)
    assert _within_ulps(rms_norm(x, weight, EPS), eager_rms_norm.__wrapped__(x, weight, EPS), 2)


def test_strided_rows_and_bad_inputs():
    x, residual, weight = _inputs(6, 64, torch.float32)
    torch.testing.assert_close(rms_norm(x[::2], weight, EPS), eager_rms_norm.__wrapped__(x[::2], weight, EPS))
    assert rms_norm(x[:0], weight, EPS).shape == (0, 64)
    assert not supports(x.view(2, 3, 64), weight)  # rows only: q/k heads take the model's own kernel
    assert not supports(x, weight.to(torch.bfloat16))
    assert not supports(x, weight, residual[:3])
    with pytest.raises(ValueError, match=r"rms_norm takes rows .*got x \(6, 64\) torch.float32, weight \(32,\)"):
        rms_norm(x, weight[:32], EPS)


def test_module_keeps_the_eager_path_off_cuda(fusion_on_without_compiling):
    """With fusion on, a CPU tensor takes the PyTorch function (the kernel runs only on CUDA tensors)."""
    x, residual, weight = _inputs(3, 32, torch.float32)
    norm = RMSNorm(32, EPS)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(norm(x), eager_rms_norm.__wrapped__(x, weight, EPS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,width", [(1, 4096), (256, 4096), (14336, 4096), (255, 1024), (7, 1000)])
def test_cuda_matches_eager(rows, width):
    x, residual, weight = _inputs(rows, width, torch.bfloat16, device="cuda")
    out, new_residual = rms_norm(x, weight, EPS, residual)
    ref, ref_residual = eager_add_rms_norm.__wrapped__(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    # rsqrt and the sum's order may move the normalised value by one float32 bit, rarely: one bf16 ulp of the
    # normalised row when its rounding flips, two of the output after the weight's product is rounded too (a
    # 14,336-row case can go past one ulp)
    assert _within_ulps(out, ref, 2)
    assert (out != ref).float().mean() < 1e-2
    assert _within_ulps(rms_norm(x, weight, EPS), eager_rms_norm.__wrapped__(x, weight, EPS), 2)
    norm = RMSNorm(width, EPS).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(weight)
    set_compile(True)
    try:
        module_out, module_residual = norm(x, residual)
        assert torch.equal(module_out, out) and torch.equal(module_residual, new_residual)
    finally:
        set_compile(False)
