"""Helpers for tests: tiny random-weight checkpoints written with ``transformers`` and a ``tokenizers``
tokenizer, so that no test downloads anything."""

from nanovllm_testing.checkpoints import (
    GPU_TEST_SHAPE,
    PARITY_PROMPTS,
    TINY_CORPUS,
    build_tokenizer,
    hf_greedy,
    hf_greedy_tokens,
    rewrite_checkpoint,
    tiny_checkpoint_fixture,
    write_tiny_checkpoint,
)
from nanovllm_testing.timing import cuda_median_ms

__all__ = ["GPU_TEST_SHAPE", "PARITY_PROMPTS", "TINY_CORPUS", "build_tokenizer", "cuda_median_ms", "hf_greedy",
           "hf_greedy_tokens", "rewrite_checkpoint", "tiny_checkpoint_fixture", "write_tiny_checkpoint"]
