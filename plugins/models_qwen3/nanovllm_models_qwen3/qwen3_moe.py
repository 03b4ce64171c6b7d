"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention with sparse mixture-of-experts feed-forward blocks.

Layer ``i`` has a MoE block when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
== 0``; the other layers have a dense MLP of ``intermediate_size``. Checkpoints may store experts per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, as released Qwen3-MoE checkpoints and transformers'
``save_pretrained`` do) or fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I], transformers' in-memory layout); both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from nanovllm_core import ModelLoadError
from nanovllm_core.loader import load_weights
from nanovllm_models_qwen3.moe import Qwen3MoeSparseBlock, expert_packed_modules, is_sparse_layer
from nanovllm_models_qwen3.qwen import Qwen3ForCausalLM, dense_mlp

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rewrite fused expert tensors into per-expert HF names (views, no copies); pass the rest through.

    ``...experts.gate_up_proj`` [E, 2I, H] becomes ``...experts.{e}.gate_proj.weight`` (rows ``:I``) and
    ``...experts.{e}.up_proj.weight`` (rows ``I:``); ``...experts.down_proj`` [E, H, I] becomes
    ``...experts.{e}.down_proj.weight``.
    """
    for name, tensor in weights:
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match["prefix"], match["kind"]
        if tensor.dim() != 3:
            raise ModelLoadError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} should have 3 dimensions")
        if kind == "gate_up_proj":
            inter = tensor.size(1) // 2
            for e in range(tensor.size(0)):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]
        else:
            for e in range(tensor.size(0)):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """transformers' ``Qwen3MoeForCausalLM``: top-k softmax routing (``num_experts_per_tok`` of
    ``num_experts``, optionally renormalised by ``norm_topk_prob``), experts of ``moe_intermediate_size``."""

    def __init__(self, config: Any) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ModelLoadError("Qwen3MoeForCausalLM with use_sliding_window=true is not supported")
        super().__init__(config)
        self.packed_modules_mapping = {**expert_packed_modules(config.num_experts), **type(self).packed_modules_mapping}

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        """A :class:`Qwen3MoeSparseBlock` in sparse layers, a dense MLP of ``intermediate_size`` elsewhere."""
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseBlock(config)
        return dense_mlp(config, layer_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF tensors (per-expert or fused expert naming), slicing experts for this rank."""
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self.tied else None
        load_weights(self, split_fused_experts(weights), self.packed_modules_mapping, tied=tied)
