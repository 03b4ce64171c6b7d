"""Helpers for tests: tiny random-weight checkpoints written with ``transformers`` and a ``tokenizers``
tokenizer, so that no test downloads anything."""

from nanovllm_core.testing.checkpoints import (
    GPU_TEST_SHAPE,
    PARITY_PROMPTS,
    TINY_CORPUS,
    build_tokenizer,
    hf_greedy,
    rewrite_checkpoint,
    write_tiny_checkpoint,
)

__all__ = ["GPU_TEST_SHAPE", "PARITY_PROMPTS", "TINY_CORPUS", "build_tokenizer", "hf_greedy", "rewrite_checkpoint",
           "write_tiny_checkpoint"]
