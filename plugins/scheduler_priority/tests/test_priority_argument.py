"""vLLM's ``priority=`` argument of ``LLM.generate`` orders the requests under this policy (one seat, so they run
one after another: the most urgent first, ties by arrival)."""

from __future__ import annotations

from nanovllm_testing import write_tiny_checkpoint

from nanovllm_core import LLM, SamplingParams


def test_generate_priority_list_orders_admission(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    llm = LLM(str(path), plugins={"scheduler": "priority"}, max_num_seqs=1, kvcache_block_size=16,
              max_model_len=128, num_kvcache_blocks=40)  # fmt: skip
    try:
        prompts = [[5, 6, 7] * 4, [8, 9] * 5, [10] * 9, [11, 12] * 3]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                            priority=[2, 0, 1, 0])  # fmt: skip
        order = sorted(range(len(prompts)), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert order == [1, 3, 2, 0]
    finally:
        llm.shutdown()
