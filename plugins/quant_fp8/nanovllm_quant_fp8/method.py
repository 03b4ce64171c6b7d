"""The ``fp8`` and ``compressed-tensors`` quantization methods: FP8 e4m3 weights, products with FP8 activations.

Three ways in, one linear method (:class:`Fp8LinearMethod`):

- ``--quantization fp8`` on a 16-bit checkpoint: each weight is quantized as it loads, one scale per output
  channel;
- a checkpoint whose ``quantization_config`` says ``quant_method: fp8`` with ``weight_block_size`` (Qwen's and
  DeepSeek's FP8 releases): FP8 weights and a ``weight_scale_inv`` per 128 x 128 block;
- ``quant_method: compressed-tensors`` with FP8 weights of the ``channel`` (or ``block``) strategy and dynamic
  per-token FP8 activations (llm-compressor's ``FP8_DYNAMIC``): FP8 weights and a ``weight_scale`` per output
  channel.

On CUDA a decode step's few rows multiply the FP8 weight directly (a weight-only kernel: the step reads weights,
and they are half the bytes), larger batches quantize their activations per token (per 128-column group with
block scales) and run an FP8 GEMM: ``torch._scaled_mm`` with row-wise scales, or this plugin's Triton kernel for
block scales. On the CPU the weights are dequantized once after loading and the product is the plain one, which
is what the tests compare with ``transformers``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanovllm_core import LinearMethod, ModelLoadError, QuantizationMethod
from nanovllm_core.distributed import all_reduce
from nanovllm_core.layers import ColumnParallelLinear, RowParallelLinear
from nanovllm_quant_fp8.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight_per_channel

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper onwards
ROUTER_SUFFIX = ".gate"  # an MoE router (``mlp.gate``): a few outputs that decide the experts; kept in 16 bits


def _kernels() -> Any:
    from nanovllm_quant_fp8 import kernels

    return kernels


class Fp8LinearMethod(LinearMethod):
    """FP8 e4m3 weights with float32 scales, per output channel (``block`` None) or per ``block`` tile.

    ``scale_name``: the checkpoint's name of the scale tensor (``weight_scale_inv``, ``weight_scale``); ``None``:
    the checkpoint holds 16-bit weights, quantized per output channel after loading."""

    def __init__(self, block: tuple[int, int] | None = None, scale_name: str | None = None) -> None:
        self.block = block
        self.scale_name = scale_name

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        layer.model_dtype = dtype
        if self.scale_name is None:  # quantized after loading
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
            return
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
        if self.block is None:
            scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
            scale.weight_block = (1, None)
        else:
            bn, bk = self.block
            self._check_block_alignment(layer, input_size, output_sizes)
            scale = nn.Parameter(
                torch.empty(-(-output_size // bn), -(-input_size // bk), dtype=torch.float32), requires_grad=False
            )
            scale.weight_block = self.block
        layer.register_parameter(self.scale_name, scale)

    def _check_block_alignment(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """A block scale covers whole blocks of one part on one rank: merged parts and tensor-parallel shards must
        start at a block."""
        bn, bk = self.block
        tp = getattr(layer, "tp_size", 1)
        split_out = len(output_sizes) > 1 or (tp > 1 and isinstance(layer, ColumnParallelLinear))
        misfit = [s for s in output_sizes if s % bn] if split_out else []
        if misfit or (tp > 1 and isinstance(layer, RowParallelLinear) and input_size % bk):
            raise ModelLoadError(
                f"FP8 block scales of {bn} x {bk}: {type(layer).__name__} with parts of {output_sizes} rows and "
                f"{input_size} columns per rank (tensor_parallel_size {tp}) do not start at whole blocks; use a "
                "tensor_parallel_size that splits the layers at multiples of the block"
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scale_name is None:
            weight = layer.weight.data
            amax = weight.abs().amax(dim=1).float()
            if isinstance(layer, RowParallelLinear):  # a shard of each row: scale to the whole row, as one rank does
                amax = all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
            weight, scale = quantize_weight_per_channel(weight, amax)
        else:
            weight, scale = layer.weight.data, getattr(layer, self.scale_name).data
            delattr(layer, self.scale_name)
        del layer.weight
        if not weight.is_cuda:  # the reference path: the dequantized weight, multiplied as it is
            layer.weight = nn.Parameter(dequantize_weight(weight, scale, self.block, layer.model_dtype), False)
            return
        layer.weight = nn.Parameter(weight, requires_grad=False)
        # float32 and contiguous as the kernels read them: [N] per channel, [N / BN, K / BK] per block
        scale = scale.float().reshape(-1) if self.block is None else scale.float().contiguous()
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if weight.dtype != FP8_DTYPE:  # dequantized (CPU)
            return F.linear(x, weight, bias)
        kernels = _kernels()
        rows = x.reshape(-1, x.size(-1))
        if kernels.supports(rows, weight):
            y = kernels.w8a16_linear(rows, weight, layer.weight_scale, self.block, bias)
        else:
            y = self._product(layer, *kernels.quantize_activation(rows, self._group), x.dtype, bias)
        return y.view(*x.shape[:-1], weight.size(0))

    @property
    def _group(self) -> int | None:
        """Columns of an activation scale: per token with per-channel weights, per weight block's columns else."""
        return None if self.block is None else self.block[1]

    def _product(
        self, layer: nn.Module, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, bias: Tensor | None = None
    ) -> torch.Tensor:
        """Quantized rows times the FP8 weight, on the FP8 tensor cores: ``torch._scaled_mm`` with row-wise scales
        for per-channel weights, this plugin's block-scaled GEMM for block weights."""
        if self.block is not None:
            return _kernels().w8a8_block_matmul(xq, x_scale, layer.weight, layer.weight_scale, self.block, dtype, bias)
        # fast accumulation, as vLLM's CUTLASS FP8 kernels use: fewer float32 promotions of the tensor cores'
        # partial sums; its error is far below the activations' FP8 rounding (the GPU test's bound holds)
        y = torch._scaled_mm(
            xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1), out_dtype=dtype,
            use_fast_accum=True,
        )  # fmt: skip
        return y if bias is None else y + bias

    def apply_after_norm(
        self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One row of a decode step (one request alone): the residual add and the norm in the weight-only kernel's
        launch (``w8a16_norm_linear``). Declined for more rows, and for rows whose activations the product
        quantizes, where the separate norm measured faster."""
        weight = layer.weight
        fits = weight.dtype == FP8_DTYPE and norm_weight.dtype == x.dtype and x.size(0) == 1
        if not fits or not _kernels().supports(x, weight):
            return None
        if residual is not None and residual.stride(-1) != 1:
            return None
        return _kernels().w8a16_norm_linear(x, weight, layer.weight_scale, self.block, norm_weight, eps, residual)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """A decode step's few rows: the SiLU-and-mul after the ``[gate; up]`` product in the weight-only kernel's
        epilogue (``w8a16_linear(..., silu_mul=True)``); the product is never written. Declined for one row with
        block scales, where the separate kernel measured faster."""
        weight = layer.weight
        if weight.dtype != FP8_DTYPE or not _kernels().supports(x, weight):
            return None
        if self.block is not None and x.numel() == x.size(-1):
            return None
        return _kernels().w8a16_linear(x, weight, layer.weight_scale, self.block, silu_mul=True)


def _fp8_check_available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None  # the dequantized reference path
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"FP8 weights need a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, "
            f"Hopper); this one is {capability[0]}.{capability[1]}"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        return "its CUDA kernels need triton: pip install triton"
    return None


class _Fp8MethodBase(QuantizationMethod):
    weight_bits = 8

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        super().__init__(checkpoint_config)
        self.ignored: list[str] = []

    @classmethod
    def check_available(cls, device: torch.device) -> str | None:
        return _fp8_check_available(device)

    def is_ignored(self, prefix: str) -> bool:
        """Whether the layer ``prefix`` stays in 16 bits: an MoE router, or named by the checkpoint's ignore list
        (a name, a name's prefix, or ``re:PATTERN``)."""
        if prefix.endswith(ROUTER_SUFFIX):
            return True
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], prefix):
                    return True
            elif prefix == entry or prefix.startswith(entry + "."):
                return True
        return False


class Fp8Method(_Fp8MethodBase):
    """vLLM's ``fp8``: quantize a 16-bit checkpoint at load (per output channel), or read one stored with
    ``quant_method: fp8`` and ``weight_block_size`` (FP8 weights, ``weight_scale_inv`` per block)."""

    quantizes_on_load: ClassVar[bool] = True

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        super().__init__(checkpoint_config)
        self.linear = Fp8LinearMethod()
        if checkpoint_config is None:
            return
        scheme = checkpoint_config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ModelLoadError(
                f"fp8 checkpoint with activation_scheme {scheme!r}: static activation scales are not supported "
                "(supported: 'dynamic')"
            )
        block = checkpoint_config.get("weight_block_size")
        well_formed = isinstance(block, list | tuple) and len(block) == 2
        if not (well_formed and all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(
                f"fp8 checkpoint with weight_block_size {block!r}: supported are block-wise scales, "
                "weight_block_size [N, K] (Qwen's and DeepSeek's FP8 releases); per-tensor scales are not"
            )
        self.linear = Fp8LinearMethod(block=(block[0], block[1]), scale_name="weight_scale_inv")
        self.ignored = list(checkpoint_config.get("modules_to_not_convert") or []) + list(
            checkpoint_config.get("ignored_layers") or []
        )

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return None if self.is_ignored(prefix) else self.linear


class CompressedTensorsFp8Method(_Fp8MethodBase):
    """vLLM's ``compressed-tensors``, its FP8 W8A8 scheme: FP8 weights with a ``weight_scale`` per output channel
    (``strategy: channel``) or per block (``strategy: block``), activations quantized per token as they come
    (``input_activations: {dynamic: true, strategy: token}``), as llm-compressor's ``FP8_DYNAMIC`` writes them."""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        super().__init__(checkpoint_config)
        if checkpoint_config is None:
            raise ModelLoadError("compressed-tensors reads checkpoints stored quantized; this one is not")
        groups = checkpoint_config.get("config_groups") or {}
        if len(groups) != 1:
            raise ModelLoadError(
                f"compressed-tensors checkpoint with {len(groups)} config_groups: supported is one group (one scheme "
                "for every Linear)"
            )
        (group,) = groups.values()
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        wanted = {"type": "float", "num_bits": 8}
        if any(weights.get(k) != v for k, v in wanted.items()) or weights.get("strategy") not in ("channel", "block"):
            raise ModelLoadError(
                f"compressed-tensors weights {_scheme(weights)}: supported are FP8 weights (type float, num_bits 8) "
                "with strategy channel or block"
            )
        if not inputs or any(inputs.get(k) != v for k, v in wanted.items()) or not inputs.get("dynamic") or (
            inputs.get("strategy") != "token"
        ):
            raise ModelLoadError(
                f"compressed-tensors input_activations {_scheme(inputs or {})}: supported are dynamic per-token FP8 "
                "activations (type float, num_bits 8, dynamic true, strategy token)"
            )
        block = None
        if weights["strategy"] == "block":
            structure = weights.get("block_structure")
            if not (isinstance(structure, list) and len(structure) == 2):
                raise ModelLoadError(
                    f"compressed-tensors block strategy with block_structure {structure!r}: want [N, K]"
                )
            block = (int(structure[0]), int(structure[1]))
        self.linear = Fp8LinearMethod(block=block, scale_name="weight_scale")
        self.ignored = list(checkpoint_config.get("ignore") or [])

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return None if self.is_ignored(prefix) else self.linear


def _scheme(args: dict[str, Any]) -> str:
    keys = ("type", "num_bits", "strategy", "dynamic")
    return "{" + ", ".join(f"{k}: {args.get(k)!r}" for k in keys if k in args) + "}"
