"""The whole engine on the ``triton`` backend, its kernels in Triton's interpreter on CPU (float32):
greedy output equal to ``transformers``, through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from nanovllm_core import LLM, SamplingParams  # noqa: E402
from nanovllm_core.testing import hf_greedy, write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def head64_path(tmp_path_factory):
    # head_dim 64: the smallest the Triton kernels take; one layer keeps the interpreter quick
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("hd64"),
        "qwen3",
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        num_layers=1,
    )


def test_engine_on_triton_matches_transformers(head64_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets check_available accept the CPU
    shared = [7, 8, 9] * 6  # 18 tokens: one full 16-token block shared by the last two prompts
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), shared + [30, 31], shared + [40]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(
        str(head64_path),
        plugins={"attention": "triton"},
        device="cpu",
        kvcache_block_size=16,
        max_model_len=128,
        num_kvcache_blocks=6,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    assert type(llm.runner.backend).__name__ == "TritonAttentionBackend"
    first = llm.generate(prompts[:3], params, use_tqdm=False)
    last = llm.generate(prompts[3:], params, use_tqdm=False)
    assert last[0].num_cached_tokens == 16
    assert llm.scheduler.num_preemptions > 0  # 6 blocks cannot hold the first three at once
    assert [o.outputs[0].token_ids for o in first + last] == hf_greedy(head64_path, prompts, 10)
