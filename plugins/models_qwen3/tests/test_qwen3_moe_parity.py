"""Qwen3-MoE through the whole engine: greedy tokens equal transformers' greedy ``generate``."""

from __future__ import annotations

import random

import pytest
import torch
from nanovllm_models_qwen3 import Qwen3MoeForCausalLM
from nanovllm_models_qwen3.moe import Qwen3MoeSparseBlock
from nanovllm_testing import hf_greedy

from nanovllm_core import LLM, SamplingParams

MAX_NEW = 32


def make_prompts(seed: int, lengths: list[int], vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


PROMPTS = make_prompts(0, [4, 17, 40, 73, 120])


def generate(path, prompts, **engine_kwargs) -> tuple[LLM, list[list[int]]]:
    kwargs = {"device": "cpu", **engine_kwargs}
    llm = LLM(str(path), kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=96, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fixture", ["moe_path", "moe_step2_path"])
def test_greedy_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    llm, ours = generate(path, PROMPTS)
    assert ours == hf_greedy(path, PROMPTS, MAX_NEW)
    assert len({tuple(t) for t in ours}) == len(ours)  # the random model does not collapse to one output
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_layer_kinds_follow_transformers(moe_path, moe_step2_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    def kinds(model, sparse_cls) -> list[str]:
        return ["moe" if isinstance(layer.mlp, sparse_cls) else "dense" for layer in model.model.layers]

    for path, expected in [(moe_path, ["moe", "dense", "moe"]), (moe_step2_path, ["dense", "moe"])]:
        config = AutoConfig.from_pretrained(path)
        assert kinds(Qwen3MoeForCausalLM(config), Qwen3MoeSparseBlock) == expected
        assert kinds(AutoModelForCausalLM.from_config(config), Qwen3MoeSparseMoeBlock) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_matches_transformers_on_cuda_fused(moe_path, monkeypatch):
    """float32 on the GPU: the fused Triton experts (float32 products, not TF32) keep greedy parity."""
    pytest.importorskip("triton")
    from nanovllm_models_qwen3 import fused_moe

    calls = []
    original = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    _, ours = generate(moe_path, PROMPTS, device="cuda", dtype="float32")
    assert calls, "the fused path was not taken on CUDA"
    assert ours == hf_greedy(moe_path, PROMPTS, MAX_NEW)


def test_greedy_matches_transformers_tensor_parallel_2(moe_path):
    """TP=2 over gloo: every rank holds half of each expert's intermediate dimension."""
    llm = LLM(
        str(moe_path),
        device="cpu",
        kvcache_block_size=16,
        max_model_len=256,
        num_kvcache_blocks=96,
        tensor_parallel_size=2,
    )
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(moe_path, PROMPTS, MAX_NEW)
