"""The quantization kit on each way into FP8: quantized at load, Qwen's block-wise releases, compressed-tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanovllm_quant_fp8.checkpoints import (
    write_dequantized_checkpoint,
    write_fake_quantized_checkpoint,
    write_fp8_checkpoint,
)
from nanovllm_quant_fp8.method import CompressedTensorsFp8Method, Fp8Method
from nanovllm_testing.conformance import QuantizationConformance


class TestFp8QuantizedAtLoad(QuantizationConformance):
    method_cls = Fp8Method

    def quantize_checkpoint(self, src: Path, dst: Path) -> tuple[Path, dict[str, Any]]:
        return src, {"quantization": "fp8"}

    def reference_checkpoint(self, src: Path, quantized: Path, dst: Path) -> Path:
        return write_fake_quantized_checkpoint(src, dst)


class StoredFp8Checkpoint(QuantizationConformance):
    """An FP8 checkpoint written in ``checkpoint_format``, against its weights dequantized."""

    checkpoint_format: str

    def quantize_checkpoint(self, src: Path, dst: Path) -> tuple[Path, dict[str, Any]]:
        return write_fp8_checkpoint(src, dst, self.checkpoint_format), {}

    def reference_checkpoint(self, src: Path, quantized: Path, dst: Path) -> Path:
        return write_dequantized_checkpoint(quantized, dst)


class TestFp8BlockCheckpoint(StoredFp8Checkpoint):
    method_cls = Fp8Method
    checkpoint_format = "fp8"


class TestCompressedTensorsCheckpoint(StoredFp8Checkpoint):
    method_cls = CompressedTensorsFp8Method
    checkpoint_format = "compressed-tensors"
