"""``LLM.embed`` (vLLM's): the last prompt token's final hidden state, L2-normalised, equals transformers' float32
``last_hidden_state`` there; beside generating requests in one batch; with async scheduling on and off."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import LLM, SamplingParams


def hf_embedding(path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_embeddings_match_transformers(qwen3_path, hf_reference, async_scheduling: str) -> None:
    llm = LLM(str(qwen3_path), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64,
              async_scheduling=async_scheduling)  # fmt: skip
    prompts = [[10, 11, 12], list(range(5, 45)), [7]]
    outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.embedding is not None and out.error is None
        got = torch.tensor(out.embedding)
        assert got.shape == (llm.hf_config.hidden_size,) and got.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, hf_embedding(qwen3_path, prompt), atol=1e-5, rtol=1e-4)
    # in one batch with a generating request, each gets its own
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    embed = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False, embed=True)
    mixed = llm.generate([prompts[0], prompts[1]], [greedy, embed], use_tqdm=False)
    assert mixed[0].embedding is None and mixed[0].outputs[0].token_ids == hf_reference(qwen3_path, [prompts[0]], 8)[0]
    torch.testing.assert_close(torch.tensor(mixed[1].embedding), torch.tensor(outputs[1].embedding))


def test_embed_takes_one_sample_and_bad_prompts_get_errors(qwen3_path) -> None:
    from nanovllm_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="embed=True is invalid: allowed True or False \\(True with n=1"):
        SamplingParams(embed=True, n=2)
    llm = LLM(str(qwen3_path), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)
    good, bad = llm.embed([[1, 2, 3], [10**6]], use_tqdm=False)
    assert good.embedding is not None and bad.error and bad.embedding is None
