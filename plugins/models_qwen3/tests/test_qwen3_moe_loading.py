"""Expert weights load from per-expert HF names (released checkpoints, ``save_pretrained``) and from
transformers' fused in-memory names, and a missing expert tensor is a clear error."""

from __future__ import annotations

import re

import pytest
import torch
from nanovllm_models_qwen3.qwen3_moe import Qwen3MoeForCausalLM

from nanovllm_core import ModelLoadError
from nanovllm_core.loader import iter_safetensors, load_hf_config

PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint in transformers' fused layout: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``."""
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        match = PER_EXPERT.match(name)
        if match is None:
            fused[name] = tensor
            continue
        prefix, expert, proj = match.groups()
        experts.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = tensor
    for prefix, projs in experts.items():
        n = len(projs["down_proj"])
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return fused


def test_save_pretrained_writes_per_expert_names(moe_path):
    names = {name for name, _ in iter_safetensors(moe_path)}
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer


def test_fused_names_load_the_same_weights(moe_path):
    config = load_hf_config(moe_path)
    weights = dict(iter_safetensors(moe_path))
    per_expert, fused = Qwen3MoeForCausalLM(config), Qwen3MoeForCausalLM(config)
    per_expert.load_weights(weights.items())
    fused.load_weights(fuse_experts(weights).items())
    a, b = dict(per_expert.named_parameters()), dict(fused.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    gate = weights["model.layers.2.mlp.experts.5.gate_proj.weight"]
    up = weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    down = weights["model.layers.2.mlp.experts.5.down_proj.weight"]
    experts = per_expert.model.layers[2].mlp.experts
    torch.testing.assert_close(experts.gate_up.weight[5], torch.cat([gate, up]), rtol=0, atol=0)
    torch.testing.assert_close(experts.down.weight[5], down, rtol=0, atol=0)


def test_missing_expert_tensor_is_named(moe_path):
    weights = dict(iter_safetensors(moe_path))
    del weights["model.layers.2.mlp.experts.3.up_proj.weight"]
    model = Qwen3MoeForCausalLM(load_hf_config(moe_path))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.gate_up\.weight#\(3, 1\)"):
        model.load_weights(weights.items())


def test_unknown_expert_index_is_an_error(moe_path):
    weights = dict(iter_safetensors(moe_path))
    weights["model.layers.0.mlp.experts.8.down_proj.weight"] = weights["model.layers.0.mlp.experts.0.down_proj.weight"]
    model = Qwen3MoeForCausalLM(load_hf_config(moe_path))
    with pytest.raises(ModelLoadError, match=r"experts\.8\.down_proj"):
        model.load_weights(weights.items())
