"""Building blocks for model plugins: tensor-parallel-ready linears and embeddings, norms, rotary, attention."""

from nanovllm_core.layers.activation import SiluAndMul
from nanovllm_core.layers.attention import Attention
from nanovllm_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm_core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from nanovllm_core.layers.norm import RMSNorm
from nanovllm_core.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "get_rope",
]
