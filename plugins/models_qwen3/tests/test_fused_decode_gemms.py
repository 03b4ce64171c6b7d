"""The decoder layer's fused path: each RMSNorm folded into the projection after it, SwiGLU into ``down_proj``
(``nanovllm_core.layers.fused_linear``). On CUDA it runs where the device's tuned table covers the batch; here
the table lookup is patched to cover every shape, so the same Triton GEMM runs in the interpreter, and the
engine's greedy tokens must equal the unfused engine's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_core import LLM, SamplingParams  # noqa: E402
from nanovllm_core.layers import fused_linear  # noqa: E402
from nanovllm_core.layers.gemm_config import GemmConfig  # noqa: E402
from nanovllm_core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402
from nanovllm_core.layers.norm import RMSNorm  # noqa: E402

PROMPTS = [[5, 9, 13, 200, 7], [3, 3, 40, 41, 42, 43, 44, 45, 46, 47, 12]]


@pytest.fixture
def fused_everywhere(monkeypatch):
    """Every float32 CPU projection of up to 16 rows takes the fused GEMM (K split in two where allowed)."""
    used = []

    def lookup(weight: torch.Tensor, rows: int, *, split_ok: bool = True):
        if rows > 16:
            return None
        used.append((tuple(weight.shape), rows))
        return GemmConfig(16, 16, 32, split_k=2 if split_ok else 1)

    monkeypatch.setattr(fused_linear, "decode_gemm_config", lookup)
    return used


def test_norm_then_linear_and_silu_mul_then_linear_match_the_layers(fused_everywhere):
    torch.manual_seed(0)
    norm, qkv = RMSNorm(64, eps=1e-6), QKVParallelLinear(64, 16, 4, 2)
    norm.weight.data.uniform_(0.5, 1.5)
    qkv.weight.data.normal_(0, 0.1)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    y, new_residual = fused_linear.norm_then_linear(norm, qkv, x, residual)
    normed, expected_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, expected_residual)
    torch.testing.assert_close(y, qkv(normed), rtol=1e-5, atol=1e-5)
    y, same = fused_linear.norm_then_linear(norm, qkv, x, None)
    assert same is x
    torch.testing.assert_close(y, qkv(norm(x)), rtol=1e-5, atol=1e-5)

    gate_up, down = MergedColumnParallelLinear(64, [96, 96]), RowParallelLinear(96, 64)
    gate_up.weight.data.normal_(0, 0.1)
    down.weight.data.normal_(0, 0.1)
    h = gate_up(x)
    gate, up = h.chunk(2, dim=-1)
    expected = down(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(fused_linear.silu_mul_then_linear(down, h), expected, rtol=1e-5, atol=1e-5)
    assert len(fused_everywhere) == 3


def test_engine_tokens_with_fused_gemms_equal_unfused(dense_path, fused_everywhere):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kwargs = dict(kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40, enforce_eager=True)
    fused = [o.outputs[0].token_ids for o in LLM(str(dense_path), **kwargs).generate(PROMPTS, params, use_tqdm=False)]
    # decode steps (2 rows) took the fused GEMMs: both norms and the MLP of each of the two layers
    assert {rows for _, rows in fused_everywhere} >= {2} and len(fused_everywhere) >= 3 * 2
    fused_everywhere.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_linear, "decode_gemm_config", lambda *a, **k: None)
        plain = [o.outputs[0].token_ids for o in LLM(str(dense_path), **kwargs).generate(PROMPTS, params,
                                                                                          use_tqdm=False)]  # fmt: skip
    assert fused == plain


def test_device_table_parses_and_covers_what_it_says(monkeypatch):
    table = fused_linear._device_table("NVIDIA H200")
    assert table, "the H200 table is missing from gemm_configs.json"
    for (n, k), entries in table.items():
        rows = [r for r, _ in entries]
        assert rows == sorted(rows) and n > 0 and k > 0
    assert fused_linear._device_table("a device nobody measured") == {}
    with pytest.raises(ValueError, match="expected m<block_m>"):
        fused_linear.parse_config("m16n16")
