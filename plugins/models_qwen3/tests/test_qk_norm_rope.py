"""The fused q/k RMSNorm + rotary kernel against the torch path (``rms_norm`` then ``apply_rotary``, eager).

On CPU the kernel runs in Triton's interpreter (slow: shapes stay small). The interpreter rounds float32 to
bfloat16 by truncation where CUDA rounds to nearest, so bfloat16 results are compared within a few bf16 ulps;
float32 results must agree to rounding noise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_models_qwen3.qk_norm_rope import qk_norm_rope  # noqa: E402

from nanovllm_core.layers.fused import apply_rotary, rms_norm  # noqa: E402
from nanovllm_core.layers.rotary import RotaryEmbedding  # noqa: E402

EPS = 1e-6
MAX_POSITION = 4096
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.1, "rtol": 0.02}}


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, with_weights, device="cpu", seed=0):
    """q and k as views into one qkv row per token (as the attention layer splits them), shuffled positions."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (3 * torch.randn(num_tokens, width, generator=gen)).to(dtype).to(device)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    positions = torch.randperm(MAX_POSITION, generator=gen)[:num_tokens].to(device)
    weights = [None, None]
    if with_weights:
        weights = [(0.5 + torch.rand(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)]
    rope = RotaryEmbedding(head_dim, rotary_dim, MAX_POSITION, 1_000_000.0).to(device)
    return positions, q, k, weights, rope.cos_sin_cache


def _reference(positions, q, k, weights, cos_sin_cache, rotary_dim):
    if weights[0] is not None:
        q, k = rms_norm.__wrapped__(q, weights[0], EPS), rms_norm.__wrapped__(k, weights[1], EPS)
    return apply_rotary.__wrapped__(positions, q, k, cos_sin_cache, rotary_dim)


def _check(num_tokens, heads, head_dim, dtype, with_weights, rotary_dim=None, device="cpu"):
    rotary_dim = rotary_dim or head_dim
    positions, q, k, weights, cache = _inputs(num_tokens, *heads, head_dim, rotary_dim, dtype, with_weights, device)
    assert num_tokens < 2 or not (q.is_contiguous() or k.is_contiguous())
    q_out, k_out = qk_norm_rope(positions, q, k, *weights, EPS, cache, rotary_dim)
    q_ref, k_ref = _reference(positions, q, k, weights, cache, rotary_dim)
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    "num_tokens, heads, head_dim, dtype, with_weights",
    [
        (1, (16, 8), 128, torch.bfloat16, True),
        (1, (4, 1), 64, torch.float32, False),
        (7, (16, 8), 64, torch.float32, True),
        (7, (16, 8), 128, torch.bfloat16, False),
        (7, (4, 1), 128, torch.bfloat16, True),
        (7, (4, 1), 64, torch.float32, True),
        (130, (4, 1), 64, torch.float32, True),
        (130, (16, 8), 128, torch.bfloat16, True),
    ],
)
def test_matches_torch_path(num_tokens, heads, head_dim, dtype, with_weights):
    _check(num_tokens, heads, head_dim, dtype, with_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_and_odd_head_dim(dtype):
    """Dims past ``rotary_dim`` pass through (normalised); a head_dim that is no power of two is masked."""
    _check(5, (4, 2), 128, dtype, True, rotary_dim=32)
    _check(3, (4, 2), 96, dtype, True, rotary_dim=96)


def test_no_tokens():
    positions, q, k, weights, cache = _inputs(0, 4, 2, 64, 64, torch.float32, True)
    q_out, k_out = qk_norm_rope(positions, q, k, *weights, EPS, cache, 64)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


def test_rejects_mismatched_weight_dtype():
    positions, q, k, weights, cache = _inputs(2, 4, 2, 64, 64, torch.bfloat16, True)
    with pytest.raises(ValueError, match="dtype"):
        qk_norm_rope(positions, q, k, weights[0].float(), weights[1].float(), EPS, cache, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_weights", [True, False])
def test_compiled_kernel_on_cuda(with_weights):
    _check(4096, (16, 8), 128, torch.bfloat16, with_weights, device="cuda")
