"""Building blocks for model plugins: tensor-parallel-ready linears and embeddings, norms, rotary, attention;
:func:`norm_linear` runs a norm and the projection after it (one kernel for a decode step's few rows).

Also for kernel authors: :func:`wrap_kernel` runs a ``@triton.jit`` kernel compiled on CUDA or in Triton's
interpreter on CPU (how CI tests kernels), :func:`fused_enabled` says whether the engine asked for
fused/compiled small ops on this device (``compile_small_ops``), and :func:`launch_options` gives a launch's
programmatic-dependent-launch arguments (``programmatic_dependent_launch``; ``triton_jit`` says how a kernel
opts in).
"""

from nanovllm_core.layers.activation import SiluAndMul
from nanovllm_core.layers.attention import Attention
from nanovllm_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm_core.layers.fused import fused_enabled
from nanovllm_core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    norm_linear,
)
from nanovllm_core.layers.norm import RMSNorm
from nanovllm_core.layers.rotary import RotaryEmbedding, get_rope
from nanovllm_core.layers.triton_jit import launch_options, wrap_kernel

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
    "fused_enabled",
    "get_rope",
    "launch_options",
    "norm_linear",
    "wrap_kernel",
]
