"""The whole engine on the ``triton`` backend, its kernels in Triton's interpreter on CPU (float32):
greedy output equal to ``transformers``, through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_testing import hf_greedy, tiny_checkpoint_fixture  # noqa: E402

from nanovllm_core import LLM, SamplingParams  # noqa: E402

# head_dim 64: the smallest the Triton kernels take; one layer keeps the interpreter quick
head64_path = tiny_checkpoint_fixture(
    "qwen3", scope="module", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=64, num_layers=1
)


SHARED = [7, 8, 9] * 6  # 18 tokens: one full 16-token block shared by the last two prompts
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), SHARED + [30, 31], SHARED + [40]]


def run_engine(path, num_kvcache_blocks: int, **kwargs):
    """The engine on 16-token blocks; the last prompt runs after the others, so its first block is a prefix hit.
    Returns the engine and each prompt's 10 greedy tokens."""
    llm = LLM(
        str(path),
        device="cpu",
        kvcache_block_size=16,
        max_model_len=128,
        num_kvcache_blocks=num_kvcache_blocks,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False) + llm.generate(PROMPTS[3:], params, use_tqdm=False)
    assert outs[-1].num_cached_tokens == 16
    return llm, [o.outputs[0].token_ids for o in outs]


def test_engine_on_triton_matches_transformers(head64_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets check_available accept the CPU
    llm, tokens = run_engine(head64_path, 6, plugins={"attention": "triton"})
    assert type(llm.runner.backend).__name__ == "TritonAttentionBackend"
    assert llm.scheduler.num_preemptions > 0  # 6 blocks cannot hold the first three at once
    assert tokens == hf_greedy(head64_path, PROMPTS, 10)


def test_engine_on_triton_fp8_cache_matches_torch_backend(head64_path, monkeypatch):
    """``kv_cache_dtype="fp8"``: the interpreted kernels give the ``torch`` backend's greedy tokens on the same
    FP8 cache (both read identical e4m3 values and scales), through chunked prefill, a prefix hit and decode."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    outputs = {}
    for backend in ("triton", "torch"):
        llm, outputs[backend] = run_engine(head64_path, 12, plugins={"attention": backend}, kv_cache_dtype="fp8")
        assert llm.runner.kv_cache.dtype == torch.uint8
    assert outputs["triton"] == outputs["torch"]
