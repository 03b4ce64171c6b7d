"""Linear layers that shard their weight over tensor-parallel ranks and load HF tensors into the shard.

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that slices the full HF
tensor for this rank; :func:`nanovllm_core.loader.load_weights` calls it.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_core.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm_core.layers.activation import SiluAndMul
from nanovllm_core.layers.fused import fused_enabled
from nanovllm_core.layers.triton_jit import kernel_module


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


_SILU_AND_MUL = SiluAndMul()  # stateless: one instance instead of a module built per call


def _skinny_kernels(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """``skinny_gemm_kernel`` when it takes ``x`` and ``weight`` (a decode step's few rows on CUDA, with the
    hand-fused kernels on: ``compile_small_ops``; that module says why), else None."""
    if x.is_cuda and fused_enabled():
        kernels = kernel_module("skinny_gemm_kernel")
        if kernels is not None and kernels.supports(x, weight):
            return kernels
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the skinny kernel for a decode step's few rows (:func:`_skinny_kernels`)."""
    kernels = _skinny_kernels(x, weight) if bias is None else None
    return kernels.skinny_linear(x, weight) if kernels is not None else F.linear(x, weight, bias)


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(_Linear):
    """The same full weight on every rank."""


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, _divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = param.data.size(0)
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. ``gate_proj`` and ``up_proj``)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(src)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiluAndMul()(self(x))`` for a ``[gate, up]`` projection; a decode step's few rows take one kernel for
        both, without writing the projection."""
        gate_up = self.bias is None and len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        kernels = _skinny_kernels(x, self.weight) if gate_up else None
        if kernels is not None:
            return kernels.skinny_linear(x, self.weight, silu_mul=True)
        return _SILU_AND_MUL(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads split by rank, KV heads replicated if ranks > KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, num_kv_heads, "tensor_parallel_size over KV heads")
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, index * size, size))


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(_divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: not sharded
            param.data.copy_(loaded_weight)
            return
        shard = param.data.size(1)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y
