"""The fused Triton MoE path against the plain PyTorch path: under Triton's CPU interpreter (skipped
without Triton) and on a GPU at Qwen3-30B-A3B expert shapes (``gpu`` marker, skipped without CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from nanovllm_models_qwen3 import moe
from nanovllm_models_qwen3.moe import route
from nanovllm_models_qwen3.moe_torch import torch_experts


def random_moe(
    num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    """Inputs with outputs of order one: x ~ N(0, 1), weights scaled by 1/sqrt(fan-in), softmax routing."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=device)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    weights, ids = route(logits, top_k, norm_topk_prob=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids


INTERPRETED_CHECK = """
import json, sys, torch
from nanovllm_models_qwen3 import fused_moe
from nanovllm_models_qwen3.moe_torch import torch_experts
sys.path.insert(0, sys.argv[1])
from test_qwen3_moe_kernels import random_moe, random_topk_ids
assert type(fused_moe._down_kernel).__name__ == "InterpretedFunction"
cfg = fused_moe.MoeKernelConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
result = {"experts": {}, "align": []}
for num_tokens in (1, 37):
    x, w13, w2, weights, ids = random_moe(num_tokens, 64, 48, 8, 2, torch.float32, "cpu", seed=num_tokens)
    out = fused_moe.fused_experts(x, w13, w2, weights, ids, cfg)
    ref = torch_experts(x, w13, w2, weights, ids)
    result["experts"][num_tokens] = [(out - ref).abs().max().item(), ref.abs().max().item()]
for num_tokens, num_experts, top_k, block_m in [(1, 8, 2, 16), (37, 8, 2, 16), (9, 5, 2, 4), (30, 128, 8, 16)]:
    ids = random_topk_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    kernel = fused_moe.align_block_size(ids, num_experts, block_m, use_kernel=True)
    plain = fused_moe.align_block_size(ids, num_experts, block_m, use_kernel=False)
    result["align"].append(all(torch.equal(a, b) for a, b in zip(kernel, plain)))
print(json.dumps(result))
"""


def random_topk_ids(num_tokens: int, num_experts: int, top_k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """[T, top_k] distinct experts per token, as top-k routing gives."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g, device=device)
    return scores.topk(top_k, dim=-1).indices


def test_align_block_size_groups_rows_by_expert():
    pytest.importorskip("triton")
    from nanovllm_models_qwen3.fused_moe import align_block_size

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]])
    sorted_pairs, block_experts = align_block_size(ids, num_experts=5, block_m=4)
    pad = ids.numel()
    assert sorted_pairs.numel() % 4 == 0 and block_experts.numel() == sorted_pairs.numel() // 4
    # expert 0: 3 rows, 1: 1, 2: 1, 3: 5 (two blocks), 4: none; then unused blocks marked -1
    assert block_experts.tolist()[:5] == [0, 1, 2, 3, 3]
    assert set(block_experts.tolist()[5:]) <= {-1}
    for block, expert in zip(sorted_pairs.view(-1, 4).tolist(), block_experts.tolist()):
        real = [p for p in block if p != pad]
        assert all(ids.view(-1)[p] == expert for p in real)
        assert real == sorted(real)  # stable: pairs keep token order within an expert
        if expert == -1:
            assert real == []
    assert sorted(p for p in sorted_pairs.tolist() if p != pad) == list(range(pad))


def test_interpreted_fused_matches_torch():
    """The Triton kernels under ``TRITON_INTERPRET=1`` (a fresh process: the variable must be set before
    Triton is first imported), float32, against the plain path."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CHECK, here], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for num_tokens, (err, ref_max) in result["experts"].items():
        assert ref_max > 0.1, num_tokens
        assert err <= 1e-5 * max(1.0, ref_max), (num_tokens, err)
    assert result["align"] == [True] * 4  # the single-kernel alignment equals the PyTorch one


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 333, 4096])
def test_fused_matches_torch_qwen3_30b_a3b_shapes(num_tokens):
    pytest.importorskip("triton")
    from nanovllm_models_qwen3.fused_moe import fused_experts

    x, w13, w2, weights, ids = random_moe(num_tokens, 2048, 768, 128, 8, torch.bfloat16, "cuda", seed=num_tokens)
    plain = torch_experts(x, w13, w2, weights, ids)
    fused = fused_experts(x, w13, w2, weights, ids)
    exact = torch_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    scale = exact.abs().mean().item()
    torch.testing.assert_close(fused.double(), exact, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(fused, plain, rtol=4e-2, atol=4e-2 * scale)
    fused_err = (fused.double() - exact).abs().mean().item()
    plain_err = (plain.double() - exact).abs().mean().item()
    assert fused_err <= 1.5 * plain_err  # at least as accurate as the bf16 PyTorch path

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10

    t_fused = timed(lambda: fused_experts(x, w13, w2, weights, ids))
    t_plain = timed(lambda: torch_experts(x, w13, w2, weights, ids))
    print(
        f"\nT={num_tokens}: fused {t_fused * 1e3:.3f} ms, plain {t_plain * 1e3:.3f} ms, "
        f"mean |err| fused {fused_err:.2e} plain {plain_err:.2e}"
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 5, 32])
def test_align_kernel_matches_torch_on_cuda(num_tokens):
    pytest.importorskip("triton")
    from nanovllm_models_qwen3.fused_moe import align_block_size

    ids = random_topk_ids(num_tokens, 128, 8, seed=num_tokens, device="cuda")
    for block_m in (16, 64):
        kernel = align_block_size(ids, 128, block_m, use_kernel=True)
        plain = align_block_size(ids, 128, block_m, use_kernel=False)
        assert all(torch.equal(a, b) for a, b in zip(kernel, plain)), block_m


@pytest.mark.gpu
@needs_cuda
def test_block_picks_fused_path_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    x = torch.zeros(2, 8, device="cuda")
    assert moe.uses_fused_path(x)
    assert not moe.uses_fused_path(x.cpu())
    monkeypatch.setattr(moe, "USE_FUSED_MOE", False)
    assert not moe.uses_fused_path(x)
