"""FP8 checkpoints written from 16-bit ones, in the tensor names, dtypes and ``config.json`` of the real releases
(for tests and benchmarks: nothing is downloaded), and their dequantized 16-bit twins (the reference).

- ``fp8``: Qwen's FP8 releases (``Qwen3-8B-FP8``): every linear layer's ``weight`` in float8 e4m3 beside a
  ``weight_scale_inv`` of one bfloat16 scale per 128 x 128 block; ``quantization_config`` ``{"quant_method":
  "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}``.
- ``compressed-tensors``: llm-compressor's ``FP8_DYNAMIC`` (the ``-FP8-dynamic`` releases): ``weight`` in float8
  e4m3 beside a ``weight_scale`` ``[N, 1]`` in the model's dtype, one per output channel, the LM head ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from nanovllm_testing import rewrite_checkpoint

from nanovllm_core.loader import iter_safetensors
from nanovllm_quant_fp8.fp8 import dequantize_weight, quantize_weight_blockwise, quantize_weight_per_channel

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Qwen decoder layer that the releases store in FP8 (embeddings, norms, the LM head and an
MoE router stay 16-bit)."""
FORMATS = ("fp8", "compressed-tensors")


def is_quantized_linear(name: str) -> bool:
    """Whether the tensor ``name`` is a linear layer's weight that these checkpoints store in FP8 (MoE experts
    are not: this plugin's methods do not quantize them)."""
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_LAYERS and ".experts." not in name


def fp8_block_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def compressed_tensors_config() -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor writes for ``FP8_DYNAMIC`` (the fields vLLM reads)."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**scheme, "strategy": "token", "dynamic": True, "observer": None},
                "output_activations": None,
            }
        },
    }


def write_fp8_checkpoint(
    src: str | Path, dst: str | Path, fmt: str = "fp8", block: tuple[int, int] = (128, 128)
) -> Path:
    """``src`` (a 16-bit checkpoint) stored as ``fmt`` (:data:`FORMATS`) into ``dst``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 checkpoint format {fmt!r}; allowed: {', '.join(FORMATS)}")

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized_linear(name):
            return {name: tensor}
        if fmt == "fp8":
            wq, scale = quantize_weight_blockwise(tensor, block)
            return {name: wq, f"{name}_scale_inv": scale.to(torch.bfloat16)}
        wq, scale = quantize_weight_per_channel(tensor)
        return {name: wq, f"{name}_scale": scale.to(tensor.dtype).unsqueeze(1)}

    def update(config: dict[str, Any]) -> None:
        config["quantization_config"] = fp8_block_config(block) if fmt == "fp8" else compressed_tensors_config()

    return rewrite_checkpoint(Path(src), Path(dst), convert, update)


def write_dequantized_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 checkpoint ``src`` (either format) with its weights dequantized to ``dtype`` and no
    ``quantization_config``: what ``transformers`` runs as the reference."""
    src = Path(src)
    config = json.loads((src / "config.json").read_text())
    quant = config["quantization_config"]
    block = tuple(quant["weight_block_size"]) if quant["quant_method"] == "fp8" else None
    scales = {name: t for name, t in iter_safetensors(src) if name.endswith(("_scale", "_scale_inv"))}

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name in scales:
            return {}
        if is_quantized_linear(name):
            scale = scales.get(f"{name}_scale_inv", scales.get(f"{name}_scale"))
            return {name: dequantize_weight(tensor, scale, block, dtype)}
        return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor}

    return rewrite_checkpoint(src, Path(dst), convert, lambda c: c.pop("quantization_config"))


def write_fake_quantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """``src`` (16-bit) with each linear weight rounded through FP8 per output channel as ``--quantization fp8``
    does at load: the reference of a checkpoint quantized on the fly."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized_linear(name):
            return {name: tensor}
        wq, scale = quantize_weight_per_channel(tensor)
        return {name: dequantize_weight(wq, scale, None, tensor.dtype)}

    return rewrite_checkpoint(src, dst, convert)
