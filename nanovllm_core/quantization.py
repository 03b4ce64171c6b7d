"""Quantization methods: how a model's linear layers store their weights and multiply by them (vLLM's split).

A :class:`QuantizationMethod` is a plugin kind, registered by name (``nanovllm_register_quantization_methods``;
vLLM's ``--quantization`` names: ``fp8``, ``compressed-tensors``) and picked by ``quantization = "fp8"`` or by a
checkpoint's own ``quantization_config``. It hands each linear layer a :class:`LinearMethod`, which

- creates the layer's parameters (``create_weights``): the weight in its stored dtype and any scales, each with
  the sharding attributes below so that the layer's own ``weight_loader`` slices a checkpoint tensor for this
  tensor-parallel rank as it slices the weight;
- processes them once all are loaded (``process_weights_after_loading``): quantize a 16-bit weight, convert
  scales, lay them out for a kernel;
- computes the product (``apply``), and may take the elementwise steps around it into the product's launch: the
  RMSNorm before it (``apply_after_norm``) and a ``[gate; up]`` projection's SiLU-and-mul after it
  (``apply_silu_and_mul``), so that the 16-bit rows between them are never written and read back.

Layers without a method of their own use :data:`nanovllm_core.layers.linear.UNQUANTIZED`, the plain
``x @ w.T``. A model plugin builds its layers from :mod:`nanovllm_core.layers.linear` and never learns which method
runs: the engine builds the model, then :func:`nanovllm_core.layers.linear.quantize_model` asks the method, layer
by layer (by the layer's dotted name), which to use.

Sharding attributes of a parameter (read by :func:`weight_narrow`): ``weight_block = (rows, cols)``, how many of
the weight's rows and columns one entry covers (``(128, 128)`` for a block scale, ``(1, None)`` for a
per-output-channel scale ``[N, 1]``: ``None`` means the dimension is not split by rank); absent means ``(1, 1)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn


def weight_narrow(param: torch.Tensor, tensor: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """``tensor.narrow(dim, start, size)`` where ``start`` and ``size`` count the weight's rows (``dim`` 0) or
    columns (``dim`` 1) and ``tensor`` is laid out as ``param`` is (its ``weight_block``): a scale entry per block
    narrows by blocks; a dimension the scale does not split (``None``) is taken whole."""
    block = getattr(param, "weight_block", None)
    unit = 1 if block is None else block[dim]
    if unit is None:
        return tensor
    if unit == 1:
        return tensor.narrow(dim, start, size)
    if start % unit:
        raise ValueError(f"a shard starting at {start} does not start at a block of {unit}")
    return tensor.narrow(dim, start // unit, min(-(-size // unit), tensor.size(dim) - start // unit))


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes ``x @ w.T (+ bias)``."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        """Register ``layer``'s ``weight`` (and any scales) for this rank's ``output_size x input_size`` shard;
        ``output_sizes`` are the rank's parts of a merged projection (``[q, k, v]``, ``[gate, up]``; one part
        otherwise), ``dtype`` the model's. Each parameter's ``weight_loader`` is set by the layer afterwards."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, after every tensor of the checkpoint is loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` in ``x``'s dtype, for ``x`` of any leading shape."""

    def apply_after_norm(
        self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(apply(layer, h), new_residual)`` for ``h, new_residual = RMSNorm(x + residual), x + residual`` (``x``
        itself without a residual), the norm as :class:`nanovllm_core.layers.norm.RMSNorm` computes it; or None,
        the default, where the method has nothing better than the norm then :meth:`apply` (the caller runs those).
        Called for bias-free layers only, ``x`` 2-D rows, and not for a ``[gate; up]`` projection whose activation
        follows (that one is :meth:`apply_silu_and_mul`'s)."""
        return None

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``apply(layer, x)`` for a bias-free ``[gate; up]`` projection of two equal halves
        (any leading shape), the activation as :class:`nanovllm_core.layers.activation.SiluAndMul` computes it; or
        None, the default, where the method has nothing better than the product then the activation (the caller
        runs them)."""
        return None


class QuantizationMethod(ABC):
    """A quantization method (the plugin kind): which :class:`LinearMethod` each linear layer uses.

    Built once per model as ``cls(checkpoint_config, **quantization_options)``: ``checkpoint_config`` is the
    checkpoint's ``quantization_config`` (``config.json``) when the checkpoint is stored quantized, ``None`` when
    it is a 16-bit checkpoint to quantize as it loads (``--quantization fp8`` on a bf16 checkpoint). A method that
    cannot read a given checkpoint config raises :class:`~nanovllm_core.errors.ModelLoadError` saying what it
    found and what it reads.
    """

    quantizes_on_load: ClassVar[bool] = False
    """Whether it can quantize a 16-bit checkpoint at load (``checkpoint_config`` None); a method that only reads
    pre-quantized checkpoints refuses a plain one with one line."""
    weight_bits: ClassVar[int] = 16
    """Bits of a quantized weight element, for the throughput bound (scales not counted: it stays a bound)."""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        self.checkpoint_config = checkpoint_config

    @classmethod
    def check_available(cls, device: torch.device) -> str | None:
        """``None`` when the method runs on ``device``, else why not, in one line (e.g. the GPU generation it
        needs)."""
        return None

    @abstractmethod
    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        """The method of the linear layer named ``prefix`` (``model.layers.0.self_attn.qkv_proj``), or ``None``
        to leave it unquantized (a layer the checkpoint keeps in 16 bits, an MoE router)."""
