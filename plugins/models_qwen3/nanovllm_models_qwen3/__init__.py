"""Qwen-family model architectures for nanovllm."""

from nanovllm_models_qwen3.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm_models_qwen3.qwen3_moe import Qwen3MoeForCausalLM

__version__ = "0.1.0"
__all__ = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
