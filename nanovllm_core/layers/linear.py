"""Linear layers that shard their weight over tensor-parallel ranks and load HF tensors into the shard.

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that slices the full HF
tensor for this rank; :func:`nanovllm_core.loader.load_weights` calls it. A layer stores and multiplies its weight
through its ``quant_method`` (:mod:`nanovllm_core.quantization`): the plain 16-bit product unless a
quantization method gave it another; the loaders slice a quantized layer's scales as they slice its weight.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_core.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm_core.layers.activation import SiluAndMul
from nanovllm_core.layers.fused import fused_enabled
from nanovllm_core.layers.norm import RMSNorm
from nanovllm_core.layers.triton_jit import kernel_module
from nanovllm_core.quantization import LinearMethod, QuantizationMethod, weight_narrow


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


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model's dtype; ``F.linear``, or the core's few-row kernel on a decode step."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
"""The method of every layer that no quantization method claims (stateless: one instance)."""


def _is_gate_up(layer: nn.Module) -> bool:
    """Whether ``layer`` is a bias-free ``[gate; up]`` projection of two equal halves."""
    sizes = getattr(layer, "output_sizes", None)
    return layer.bias is None and sizes is not None and len(sizes) == 2 and sizes[0] == sizes[1]


def norm_linear(
    x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, layer: nn.Module, silu_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(h), new_residual)`` where ``h, new_residual = norm(x, residual)`` (``norm(x)`` and ``x`` when
    ``residual`` is None); with ``silu_mul`` ``layer.silu_and_mul(h)`` (a ``MergedColumnParallelLinear`` of
    ``[gate, up]``). For a decode step's few rows the skinny kernel adds, normalises and projects in one launch
    (``skinny_gemm_kernel.skinny_norm_linear``) when ``norm`` is an :class:`RMSNorm` and ``layer`` a bias-free
    replicated or column-parallel linear; a quantized layer's method may take the norm into its product
    (``LinearMethod.apply_after_norm``; with ``silu_mul``, the activation instead: ``apply_silu_and_mul``);
    otherwise it is exactly the two calls."""
    kernels = _norm_linear_kernels(x, norm, residual, layer, silu_mul)
    if kernels is not None:
        return kernels.skinny_norm_linear(x, layer.weight, norm.weight, norm.eps, residual, silu_mul=silu_mul)
    if not silu_mul and _method_fuses_norm(x, norm, residual, layer):
        fused = layer.quant_method.apply_after_norm(layer, x, norm.weight, norm.eps, residual)
        if fused is not None:
            return fused
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    return (layer.silu_and_mul(h) if silu_mul else layer(h)), residual


def _overrides(layer: nn.Module, hook: str) -> bool:
    """Whether ``layer``'s quantization method implements ``hook`` (the base class's default declines)."""
    return getattr(type(layer.quant_method), hook, None) is not getattr(LinearMethod, hook)


def _method_fuses_norm(x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, layer: nn.Module) -> bool:
    """Whether :func:`norm_linear` may hand the norm to ``layer``'s method (``LinearMethod.apply_after_norm``): a
    plain :class:`RMSNorm` and a plain bias-free column-parallel or replicated layer (nothing overrides what the
    method replaces), 2-D rows."""
    ok = isinstance(layer, _Linear) and _overrides(layer, "apply_after_norm") and x.dim() == 2
    ok = ok and layer.bias is None and type(norm).forward is RMSNorm.forward and type(layer).forward is _Linear.forward
    return ok and (residual is None or residual.shape == x.shape)


def _norm_linear_kernels(
    x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, layer: nn.Module, silu_mul: bool
) -> ModuleType | None:
    """``skinny_gemm_kernel`` when :func:`norm_linear` may fuse: the modules compute what the kernel does (no
    subclass overrides their forward, no bias, a row-parallel layer's all-reduce never skipped) and the tensors
    are what it takes."""
    ok = type(norm).forward is RMSNorm.forward and norm.weight.dtype == x.dtype and norm.weight.is_contiguous()
    ok = ok and type(layer).forward is _Linear.forward and layer.bias is None and layer.quant_method is UNQUANTIZED
    if silu_mul:
        ok = ok and getattr(type(layer), "silu_and_mul", None) is MergedColumnParallelLinear.silu_and_mul
        ok = ok and _is_gate_up(layer)
    if residual is not None:
        ok = ok and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return _skinny_kernels(x, layer.weight) if ok else None


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method: LinearMethod = UNQUANTIZED
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @property
    def local_output_sizes(self) -> list[int]:
        """This rank's parts of the output: one, or the parts of a merged projection (``[q, k, v]``)."""
        return [self.output_size]

    def set_quant_method(self, method: LinearMethod) -> None:
        """Store and multiply the weight through ``method``: its parameters replace the 16-bit weight (the bias
        stays), on the same device, each loaded by this layer's ``weight_loader``."""
        placeholder = self.weight
        del self.weight
        with torch.device(placeholder.device):
            method.create_weights(self, self.input_size, self.output_size, self.local_output_sizes, placeholder.dtype)
        for name, param in self.named_parameters(recurse=False):
            if name != "bias":
                param.weight_loader = self.weight_loader
        self.quant_method = method

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(_Linear):
    """The same full weight on every rank."""


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, _divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = self.output_size
        param.data.copy_(weight_narrow(param, loaded_weight, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. ``gate_proj`` and ``up_proj``)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    @property
    def local_output_sizes(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        src = weight_narrow(param, loaded_weight, 0, self.tp_rank * size, size)
        weight_narrow(param, param.data, 0, offset, size).copy_(src)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiluAndMul()(self(x))`` for a ``[gate, up]`` projection; a decode step's few rows take one kernel for
        both, without writing the projection (a quantized layer: where its method has one,
        ``LinearMethod.apply_silu_and_mul``)."""
        if _is_gate_up(self):
            kernels = _skinny_kernels(x, self.weight) if self.quant_method is UNQUANTIZED else None
            if kernels is not None:
                return kernels.skinny_linear(x, self.weight, silu_mul=True)
            if _overrides(self, "apply_silu_and_mul"):
                y = self.quant_method.apply_silu_and_mul(self, x)
                if y is not None:
                    return y
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

    @property
    def local_output_sizes(self) -> list[int]:
        return [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        src = weight_narrow(param, loaded_weight, 0, index * size, size)
        weight_narrow(param, param.data, 0, offset, size).copy_(src)


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(_divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: not sharded
            param.data.copy_(loaded_weight)
            return
        size = self.input_size
        param.data.copy_(weight_narrow(param, loaded_weight, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.quant_method.apply(self, x))
        if self.bias is not None:
            y = y + self.bias
        return y


def quantize_model(model: nn.Module, method: QuantizationMethod) -> int:
    """Give every linear layer of ``model`` the :class:`LinearMethod` that ``method`` picks for it, replacing the
    unquantized parameters it was built with; returns how many layers it quantized. Call it after building the
    model and before loading its weights."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _Linear):
            chosen = method.linear_method(name, module)
            if chosen is not None:
                module.set_quant_method(chosen)
                count += 1
    return count


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each linear layer's method finish its weights (quantize, convert scales) once all are loaded."""
    for module in model.modules():
        if isinstance(module, _Linear) and module.quant_method is not UNQUANTIZED:
            module.quant_method.process_weights_after_loading(module)
