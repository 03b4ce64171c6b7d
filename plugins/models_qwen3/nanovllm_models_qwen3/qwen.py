"""Qwen3 and Qwen2 (Qwen2.5) decoders. They differ only in attention: Qwen3 normalises q and k per head
(RMSNorm over head_dim) and has no q/k/v bias by default; Qwen2 has q/k/v bias and no q/k norm."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from nanovllm_core.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    fused_enabled,
    get_rope,
    norm_linear,
)
from nanovllm_core.loader import load_weights
from nanovllm_models_qwen3.qk_norm_rope import qk_norm_rope


class QwenAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.total_heads, self.total_kv_heads, bias=qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention from the q/k/v projection ``qkv`` on: q/k norm, rotary, attention, output projection."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda and fused_enabled():
            # one Triton kernel for both norms and the rotation (four small kernels otherwise)
            q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            eps = self.q_norm.eps if self.qk_norm else 0.0
            rope = self.rotary_emb
            q, k = qk_norm_rope(positions, q, k, q_weight, k_weight, eps, rope.cos_sin_cache, rope.rotary_dim)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(o)


class QwenMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


MlpFactory = Callable[[Any, int], nn.Module]
"""Builds the feed-forward block of decoder layer ``layer_idx``: ``factory(config, layer_idx)``."""


def dense_mlp(config: Any, layer_idx: int) -> nn.Module:
    """The default :data:`MlpFactory`: a dense SwiGLU MLP of ``config.intermediate_size`` in every layer."""
    return QwenMLP(config)


class QwenDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, qkv_bias: bool, qk_norm: bool, layer_idx: int = 0, mlp_factory: MlpFactory = dense_mlp
    ) -> None:
        super().__init__()
        self.self_attn = QwenAttention(config, qkv_bias, qk_norm)
        self.mlp = mlp_factory(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the norms fold into the projections after them (norm_linear: one kernel for a decode step's few rows)
        attn = self.self_attn
        qkv, residual = norm_linear(hidden_states, self.input_layernorm, residual, attn.qkv_proj)
        hidden_states = attn.attend(positions, qkv)
        if type(self.mlp) is QwenMLP:  # a dense MLP (MoE blocks and subclasses run their own forward)
            mlp = self.mlp
            hidden_states, residual = norm_linear(
                hidden_states, self.post_attention_layernorm, residual, mlp.gate_up_proj, silu_mul=True
            )
            return mlp.down_proj(hidden_states), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class QwenModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, mlp_factory: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, qkv_bias, qk_norm, i, mlp_factory) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class _QwenForCausalLM(nn.Module):
    qkv_bias: bool
    qk_norm: bool
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config, self.qkv_bias_for(config), self.qk_norm, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def qkv_bias_for(self, config: Any) -> bool:
        return self.qkv_bias

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (dense here; MoE models override this)."""
        return dense_mlp(config, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self.tied else None
        load_weights(self, weights, self.packed_modules_mapping, tied=tied)


class Qwen3ForCausalLM(_QwenForCausalLM):
    qk_norm = True

    def qkv_bias_for(self, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))


class Qwen2ForCausalLM(_QwenForCausalLM):
    qkv_bias = True
    qk_norm = False
