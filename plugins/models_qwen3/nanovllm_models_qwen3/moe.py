"""The sparse mixture-of-experts block of Qwen3-MoE: a top-k softmax router and tensor-parallel experts.

Tensor parallelism: the router is replicated; every rank holds a slice of *every* expert's intermediate
dimension (gate and up split by rows like a column-parallel linear, down split by columns like a
row-parallel linear), so each rank computes a partial output for all routed tokens and one ``all_reduce``
after the weighted combination sums them.

Two execution paths with one contract (:func:`nanovllm_models_qwen3.moe_torch.torch_experts`): plain
PyTorch (any device) and the fused Triton grouped GEMM of :mod:`nanovllm_models_qwen3.fused_moe` (CUDA).
The fused one is picked automatically on CUDA when Triton imports; set :data:`USE_FUSED_MOE` to ``False``
to force the plain path.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from torch import nn

from nanovllm_core import ModelLoadError
from nanovllm_core.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm_core.layers import ReplicatedLinear
from nanovllm_models_qwen3.moe_torch import torch_experts

USE_FUSED_MOE = True
"""Module-level switch: ``False`` forces the plain PyTorch path even on CUDA with Triton installed."""


@functools.cache
def _fused_moe_module() -> ModuleType | None:
    try:
        from nanovllm_models_qwen3 import fused_moe
    except ImportError:
        return None
    return fused_moe


def fused_moe_available() -> bool:
    """Whether :mod:`nanovllm_models_qwen3.fused_moe` (and so Triton) can be imported."""
    return _fused_moe_module() is not None


def uses_fused_path(hidden_states: torch.Tensor) -> bool:
    """The path :class:`MoeExperts` takes for this input: fused on CUDA with Triton, unless switched off."""
    return USE_FUSED_MOE and hidden_states.is_cuda and fused_moe_available()


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has a MoE block (as transformers' ``Qwen3MoeDecoderLayer``)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax (in float32) over the router logits.

    Returns ``(weights, expert_ids)``, both [T, top_k]; ``weights`` are renormalised to sum to one when
    ``norm_topk_prob`` and cast back to the logits' dtype, as in transformers.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


class _ExpertStack(nn.Module):
    """One stacked weight ``[num_experts, out_features, in_features]`` (gives the ``.weight`` name)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class MoeExperts(nn.Module):
    """All experts of one layer, this rank's slice of their intermediate dimension.

    Parameters: ``gate_up.weight`` [E, 2 * I / tp, H] (this rank's gate rows, then its up rows) and
    ``down.weight`` [E, H, I / tp]. Loaders take one HF tensor of one expert: shard id ``(expert, 0)`` for
    ``gate_proj``, ``(expert, 1)`` for ``up_proj`` and ``expert`` for ``down_proj``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ModelLoadError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by tensor_parallel_size ({self.tp_size})"
            )
        self.num_experts = num_experts
        self.local_intermediate = intermediate_size // self.tp_size
        self.gate_up = _ExpertStack(num_experts, 2 * self.local_intermediate, hidden_size)
        self.down = _ExpertStack(num_experts, hidden_size, self.local_intermediate)
        self.gate_up.weight.weight_loader = self._load_gate_up
        self.down.weight.weight_loader = self._load_down

    def _load_gate_up(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, which = shard_id
        size = self.local_intermediate
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        param.data[expert].narrow(0, which * size, size).copy_(src)

    def _load_down(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        size = self.local_intermediate
        param.data[shard_id].copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` (no all-reduce)."""
        w13, w2 = self.gate_up.weight, self.down.weight
        if uses_fused_path(hidden_states):
            fused = _fused_moe_module()
            assert fused is not None
            return fused.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids)
        return torch_experts(hidden_states, w13, w2, topk_weights, topk_ids)


class Qwen3MoeSparseBlock(nn.Module):
    """Router (``gate``) plus experts, as transformers' ``Qwen3MoeSparseMoeBlock``; returns full outputs."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported (supported: 'silu')")
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        if not 0 < self.top_k <= config.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) must be between 1 and num_experts ({config.num_experts})"
            )
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = MoeExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route(self.gate(hidden_states), self.top_k, self.norm_topk_prob)
        return all_reduce(self.experts(hidden_states, topk_weights, topk_ids))


def expert_packed_modules(num_experts: int) -> dict[str, tuple[str, tuple[int, int] | int]]:
    """Entries for :func:`nanovllm_core.loader.load_weights`' ``packed_modules`` that load the per-expert HF
    tensors ``experts.{e}.{gate,up,down}_proj.weight`` into the stacked ``experts.gate_up`` and
    ``experts.down`` weights (the loader then checks that every expert's every projection was loaded)."""
    mapping: dict[str, tuple[str, tuple[int, int] | int]] = {}
    for e in range(num_experts):
        mapping[f"experts.{e}.gate_proj"] = ("experts.gate_up", (e, 0))
        mapping[f"experts.{e}.up_proj"] = ("experts.gate_up", (e, 1))
        mapping[f"experts.{e}.down_proj"] = ("experts.down", e)
    return mapping
