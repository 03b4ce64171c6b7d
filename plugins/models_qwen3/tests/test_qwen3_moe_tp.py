"""Tensor-parallel slicing of the experts: the partial outputs of ranks 0 and 1 of TP=2 sum to TP=1's."""

from __future__ import annotations

import pytest
import torch
from nanovllm_models_qwen3 import moe
from nanovllm_models_qwen3.qwen3_moe import Qwen3MoeForCausalLM

from nanovllm_core import distributed
from nanovllm_core.loader import iter_safetensors, load_hf_config


def build(path, rank: int, size: int) -> Qwen3MoeForCausalLM:
    distributed.set_tensor_parallel(rank, size)
    try:
        model = Qwen3MoeForCausalLM(load_hf_config(path))
        model.load_weights(iter_safetensors(path))
    finally:
        distributed.set_tensor_parallel(0, 1)
    return model.eval()


@pytest.fixture
def no_all_reduce(monkeypatch):
    """One process plays each rank in turn: the all-reduce becomes the identity, the test sums by hand."""
    monkeypatch.setattr(moe, "all_reduce", lambda x: x)
    monkeypatch.setattr(distributed, "all_reduce", lambda x: x)


@pytest.mark.parametrize("layer", [0, 2])
def test_tp2_partial_outputs_sum_to_tp1(moe_path, no_all_reduce, layer):
    full = build(moe_path, 0, 1)
    ranks = [build(moe_path, r, 2) for r in range(2)]
    blocks = [m.model.layers[layer].mlp for m in (full, *ranks)]
    assert all(isinstance(b, moe.Qwen3MoeSparseBlock) for b in blocks)
    inter = full.config.moe_intermediate_size
    assert blocks[0].experts.gate_up.weight.shape[1] == 2 * inter
    assert [b.experts.gate_up.weight.shape[1] for b in blocks[1:]] == [inter, inter]
    assert [b.experts.down.weight.shape[2] for b in blocks[1:]] == [inter // 2, inter // 2]

    x = torch.randn(23, full.config.hidden_size, generator=torch.Generator().manual_seed(layer))
    with torch.no_grad():
        expected = blocks[0](x)
        parts = [b(x) for b in blocks[1:]]
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)
    for part in parts:  # each rank holds a real half, not the whole expert
        assert not torch.allclose(part, expected, atol=1e-3)


def test_tp2_slices_gate_up_and_down_consistently(moe_path):
    """Rank r's gate rows, up rows and down columns are the same slice of the intermediate dimension."""
    full = build(moe_path, 0, 1).model.layers[0].mlp.experts
    half = full.local_intermediate // 2
    for rank in range(2):
        part = build(moe_path, rank, 2).model.layers[0].mlp.experts
        rows = slice(rank * half, (rank + 1) * half)
        gate, up = full.gate_up.weight.chunk(2, dim=1)
        torch.testing.assert_close(part.gate_up.weight, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        torch.testing.assert_close(part.down.weight, full.down.weight[:, :, rows])
