"""The warm-up's prompt lengths (``warmup_prompt_lengths``): a first step that fills the token budget, within the
KV cache and ``max_num_seqs``."""

from __future__ import annotations

import pytest

from nanovllm_core.engine.model_core import WARMUP_MAX_TOKENS, warmup_prompt_lengths


def blocks(n: int, block_size: int) -> int:
    return -(-(n + WARMUP_MAX_TOKENS) // block_size)


def test_h200_defaults_fill_the_budget_then_decode_a_full_batch():
    # Qwen3-0.6B on an H200: 16,384-token steps, 256 sequences, 4,096-token context, 8,565 blocks of 256
    lengths, num_decode = warmup_prompt_lengths(16384, 256, 4096, 8565, 256)
    assert lengths == [4092] * 4 + [16] + [4092 // 3, 300, 33, 5]  # the first five add up to the budget
    assert len(lengths) + num_decode == 256


@pytest.mark.parametrize(
    "budget, max_num_seqs, max_model_len, num_blocks, block_size",
    [(200, 24, 128, 80, 16), (96, 8, 128, 40, 16), (16384, 4, 4096, 100, 256), (64, 256, 32, 10, 16),
     (8192, 256, 40960, 30, 256), (1, 1, 8, 4, 16)],  # fmt: skip
)
def test_lengths_stay_within_the_limits(budget, max_num_seqs, max_model_len, num_blocks, block_size):
    lengths, num_decode = warmup_prompt_lengths(budget, max_num_seqs, max_model_len, num_blocks, block_size)
    longest = lengths[0]
    assert longest <= min(budget, max_model_len - WARMUP_MAX_TOKENS, num_blocks * block_size // 4)
    assert all(1 <= n <= longest for n in lengths) and num_decode >= 1
    smaller = [n for n in lengths if n < longest][-4:]
    first_step = lengths[: len(lengths) - len(smaller)]  # the longest ones and the remainder
    assert sum(first_step) <= budget
    if len(first_step) > 1:  # prompts added to fill the budget leave a quarter of the cache free
        assert sum(blocks(n, block_size) for n in lengths) <= num_blocks - num_blocks // 4


def test_a_small_cache_caps_the_prompts_that_fill_the_budget():
    # 40 blocks of 16 tokens: a quarter stays free, so the first step cannot reach a 16,384-token budget
    lengths, _ = warmup_prompt_lengths(16384, 256, 128, 40, 16)
    assert lengths == [124, 124, 41, 33, 5]
    assert sum(blocks(n, 16) for n in lengths) <= 40 - 40 // 4
