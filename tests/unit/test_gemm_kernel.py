"""The Triton decode GEMM (``nanovllm_core.layers.gemm_kernel``): the same product as ``x @ w.T``, whatever the
tile, K split or ragged edge; the same bits on every call; its tile counters back at zero after each call. CPU
tests run Triton's interpreter; the GPU ones compile for the device and compare with cuBLAS."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.layers.gemm_kernel import GemmConfig, gemm

CASES = [  # rows, out, in, config: one tile, ragged M/N/K, K split unevenly, more slices than K steps
    (1, 32, 64, GemmConfig(16, 32, 32)),
    (5, 48, 96, GemmConfig(16, 32, 32, split_k=2)),
    (33, 40, 100, GemmConfig(16, 32, 32, split_k=3)),
    (17, 64, 128, GemmConfig(32, 16, 16, split_k=4)),
    (3, 16, 32, GemmConfig(16, 16, 16, split_k=8)),
]


@pytest.mark.parametrize("rows,out,inp,config", CASES, ids=[c[3].short() + f"-{c[0]}x{c[2]}" for c in CASES])
def test_matches_matmul_and_repeats_exactly(rows, out, inp, config):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, inp), torch.randn(out, inp)
    y = gemm(x, w, config)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(gemm(x, w, config), y)  # partials summed in slice order: no run-to-run drift


def test_counters_reset_and_out_is_written_in_place():
    from nanovllm_core.layers.gemm_kernel import _WORKSPACE

    x, w = torch.randn(9, 64), torch.randn(24, 64)
    out = torch.full((9, 24), float("nan"))
    assert gemm(x, w, GemmConfig(16, 16, 16, split_k=4), out=out) is out
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    assert int(_WORKSPACE.counts[x.device].abs().sum()) == 0


def test_strided_rows_and_empty_input():
    x = torch.randn(6, 80)[:, :64]  # row stride 80, unit stride along K
    w = torch.randn(32, 64)
    torch.testing.assert_close(gemm(x, w, GemmConfig(16, 32, 32, split_k=2)), x @ w.T, rtol=1e-5, atol=1e-4)
    assert gemm(torch.randn(0, 64), w, GemmConfig(16, 32, 32)).shape == (0, 32)


def test_bad_shapes_and_configs_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        gemm(torch.randn(2, 8), torch.randn(4, 16), GemmConfig(16, 16, 16))
    with pytest.raises(ValueError, match="unit stride"):
        gemm(torch.randn(8, 2).T, torch.randn(4, 8), GemmConfig(16, 16, 16))
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(24, 16, 16)
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(16, 16, 16, split_k=0)
    with pytest.raises(ValueError, match="prologue 'norm' needs split_k=1"):
        gemm(torch.randn(2, 32), torch.randn(4, 32), GemmConfig(16, 16, 16, split_k=2), prologue="norm",
             norm_weight=torch.ones(32))  # fmt: skip
    with pytest.raises(ValueError, match="one of 'none', 'norm', 'silu'"):
        gemm(torch.randn(2, 32), torch.randn(4, 32), GemmConfig(16, 16, 16), prologue="gelu")
    with pytest.raises(ValueError, match=r"x \[M, 2K\]"):
        gemm(torch.randn(2, 48), torch.randn(4, 32), GemmConfig(16, 16, 16), prologue="silu")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_is_add_rms_norm_then_the_product(with_residual):
    torch.manual_seed(1)
    x, w, g = torch.randn(21, 96), torch.randn(40, 96), torch.rand(96) + 0.5
    residual = torch.randn(21, 96) if with_residual else None
    y, new_residual = gemm(x, w, GemmConfig(16, 16, 32), prologue="norm", norm_weight=g, residual=residual, eps=1e-5)
    h = x + residual if with_residual else x
    torch.testing.assert_close(new_residual, h)
    assert with_residual or new_residual is x
    torch.testing.assert_close(y, rms_norm_reference(h, g, 1e-5) @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 3])
def test_silu_prologue_is_swiglu_then_the_product(split):
    torch.manual_seed(2)
    x, w = torch.randn(13, 2 * 80), torch.randn(24, 80)
    y = gemm(x, w, GemmConfig(16, 16, 32, split_k=split), prologue="silu")
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(y, (torch.nn.functional.silu(gate) * up) @ w.T, rtol=1e-4, atol=1e-4)


GPU_SHAPES = [(1, 4096, 1024), (64, 1024, 2048), (200, 6144, 1024), (256, 1024, 3072), (37, 4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("rows,out,inp", GPU_SHAPES)
def test_gpu_against_cublas(rows, out, inp, split):
    torch.manual_seed(0)
    x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02
    block_m = 16 if rows <= 16 else 64
    config = GemmConfig(block_m, 64, 128, split_k=split)
    y = gemm(x, w, config)
    reference = (x.float() @ w.float().T).to(torch.bfloat16)
    torch.testing.assert_close(y, reference, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(gemm(x, w, config), y)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_prologues_against_the_unfused_layers(rows):
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    x, residual = torch.randn(rows, 1024, device=dev, dtype=bf16), torch.randn(rows, 1024, device=dev, dtype=bf16)
    g = (torch.rand(1024, device=dev) + 0.5).to(bf16)
    w = torch.randn(4096, 1024, device=dev, dtype=bf16) * 0.02
    y, new_residual = gemm(x, w, GemmConfig(16 if rows <= 16 else 64, 64, 128), prologue="norm", norm_weight=g,
                           residual=residual, eps=1e-6)  # fmt: skip
    h = (x.float() + residual.float()).to(bf16)
    torch.testing.assert_close(new_residual, h)
    reference = rms_norm_reference(h.float(), g.float(), 1e-6) @ w.float().T
    torch.testing.assert_close(y.float(), reference, rtol=2e-2, atol=2e-2)
    gate_up = torch.randn(rows, 2 * 3072, device=dev, dtype=bf16)
    w_down = torch.randn(1024, 3072, device=dev, dtype=bf16) * 0.02
    y = gemm(gate_up, w_down, GemmConfig(16 if rows <= 16 else 64, 32, 128, split_k=4), prologue="silu")
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(y.float(), (torch.nn.functional.silu(gate) * up) @ w_down.float().T, rtol=2e-2,
                               atol=2e-2)  # fmt: skip


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager():
    x = torch.randn(96, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    config = GemmConfig(64, 64, 128, split_k=4)
    eager = gemm(x, w, config)
    out = torch.empty_like(eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(x, w, config, out=out)
    for _ in range(3):  # the counters reset inside the kernel, so replays keep agreeing
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
