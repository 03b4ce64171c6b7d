"""nanovllm-quant-fp8: FP8 W8A8 linear layers (quantized at load, or read from FP8 checkpoints)."""

from nanovllm_quant_fp8.method import CompressedTensorsFp8Method, Fp8LinearMethod, Fp8Method

__all__ = ["CompressedTensorsFp8Method", "Fp8LinearMethod", "Fp8Method"]
