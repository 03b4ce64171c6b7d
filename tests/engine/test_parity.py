"""Greedy output equals transformers' greedy generate, token for token, in every scheduling regime."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, MAX_NEW, PROMPTS, make_prompts

from nanovllm_core import LLM


def run(path, prompts, **engine_kwargs):
    llm = LLM(str(path), kvcache_block_size=16, max_model_len=512, **engine_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    return llm, [o.outputs[0].token_ids for o in outs], outs


@pytest.fixture(params=["qwen3", "qwen2"])
def ckpt(request, qwen3_path, qwen2_path):
    return {"qwen3": qwen3_path, "qwen2": qwen2_path}[request.param]


def test_plain(ckpt, hf_reference):
    _, ours, outs = run(ckpt, PROMPTS, num_kvcache_blocks=128)
    assert ours == hf_reference(ckpt, PROMPTS, MAX_NEW)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len({tuple(t) for t in ours}) == len(ours)  # the random model does not collapse to one output


def test_chunked_prefill(ckpt, hf_reference):
    # 48 tokens per step: the 73- and 120-token prompts are cut into chunks
    llm, ours, _ = run(ckpt, PROMPTS, num_kvcache_blocks=128, max_num_batched_tokens=48, max_num_seqs=8)
    assert ours == hf_reference(ckpt, PROMPTS, MAX_NEW)


def test_prefix_cache_hits(ckpt, hf_reference):
    shared = make_prompts(1, [50])[0]
    tails = make_prompts(2, [3, 9, 20])
    prompts = [shared + tail for tail in tails]
    llm = LLM(str(ckpt), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=128)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    outs = first + rest
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(ckpt, prompts, MAX_NEW)
    assert first[0].num_cached_tokens == 0
    # 50 shared tokens = 3 full blocks of 16 found in the cache
    assert [o.num_cached_tokens for o in rest] == [48, 48]
    # the full prompt of a repeated request is found too, except its last block's worth
    again = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 64  # 70 tokens: 4 full blocks
    assert again[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_prefix_cache_disabled_reports_no_hits(ckpt, hf_reference):
    shared = make_prompts(1, [50])[0]
    prompts = [shared + [5], shared + [6]]
    llm = LLM(str(ckpt), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=64, enable_prefix_caching=False)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(ckpt, prompts, MAX_NEW)


def test_preemption_under_kv_pressure(ckpt, hf_reference):
    # 16 blocks of 16 tokens cannot hold all five sequences (up to 152 tokens each) at once
    llm, ours, _ = run(ckpt, PROMPTS, num_kvcache_blocks=16)
    assert llm.scheduler.num_preemptions > 0
    assert ours == hf_reference(ckpt, PROMPTS, MAX_NEW)


def test_preemption_with_chunking_and_block_size_32(ckpt, hf_reference):
    llm = LLM(
        str(ckpt),
        kvcache_block_size=32,
        max_model_len=512,
        num_kvcache_blocks=9,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(ckpt, PROMPTS, MAX_NEW)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
