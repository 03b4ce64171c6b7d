"""``LLM.beam_search`` (vLLM's) on the tiny checkpoint against the same search over transformers' float32 logprobs:
the same beams, in the same order, with the same cumulative logprobs; EOS handling and the parameters' checks."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import LLM
from nanovllm_core.engine.beam_search import BeamSearchParams, beam_score
from nanovllm_core.errors import InvalidRequestError


def hf_beam_search(path, prompt: list[int], width: int, max_tokens: int, eos: frozenset[int], length_penalty: float):
    """The search ``beam_search`` runs, over transformers' logprobs: 2 * width candidates a beam and step."""
    from transformers import AutoModelForCausalLM

    from nanovllm_core.engine.beam_search import BeamSearchSequence

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    live, done = [BeamSearchSequence(list(prompt))], []

    def key(beam):
        return beam_score(beam, eos, length_penalty)

    with torch.no_grad():
        for _ in range(max_tokens):
            candidates = []
            for beam in live:
                logprobs = torch.log_softmax(model(torch.tensor([beam.tokens])).logits[0, -1].float(), -1)
                top = torch.topk(logprobs, 2 * width)
                for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                    if token in eos:
                        done.append(BeamSearchSequence(beam.tokens, [], beam.cum_logprob + logprob))
                    else:
                        candidates.append(BeamSearchSequence(beam.tokens + [token], [], beam.cum_logprob + logprob))
            live = sorted(candidates, key=key, reverse=True)[:width]
    return sorted(done + live, key=key, reverse=True)[:width]


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_match_the_search_over_transformers_logprobs(qwen3_path, width: int, length_penalty: float) -> None:
    llm = LLM(str(qwen3_path), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=128,
              enable_prefix_caching=True)  # fmt: skip
    prompts = [[10, 11, 12], [7, 8, 9, 40]]
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)
    eos = frozenset(llm.eos_token_ids)
    for prompt, output in zip(prompts, outputs):
        want = hf_beam_search(qwen3_path, prompt, width, 6, eos, length_penalty)
        assert [b.tokens for b in output.sequences] == [b.tokens for b in want]
        assert [b.cum_logprob for b in output.sequences] == pytest.approx([b.cum_logprob for b in want], abs=1e-4)
        assert all(b.text == llm.tokenizer.decode(b.tokens) for b in output.sequences)
        assert all(len(b.logprobs) == len(b.tokens) - len(prompt) or b.finish_reason == "stop"
                   for b in output.sequences)  # fmt: skip


def test_a_beam_that_samples_eos_is_complete(qwen3_path) -> None:
    """With the first token beam search picks made an EOS id and no length normalisation, the finished one-token
    beam outranks every longer one (each step adds a negative logprob): it comes first, its EOS left out of its
    tokens unless include_stop_str_in_output, and no beam holds that token inside."""
    llm = LLM(str(qwen3_path), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=128)
    prompt = [10, 11, 12]
    first = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=1))[0].sequences[0].tokens[-1]
    llm.eos_token_ids = {first}
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))[0].sequences
    assert out[0].finish_reason == "stop" and out[0].stop_reason == first and out[0].tokens == prompt
    assert all(first not in b.tokens[len(prompt) :] for b in out), "an EOS ends a beam and is not shown"
    shown = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0,
                                                       include_stop_str_in_output=True))[0].sequences  # fmt: skip
    assert shown[0].tokens == prompt + [first]


def test_bad_params_name_what_is_allowed() -> None:
    with pytest.raises(InvalidRequestError, match=r"beam_width=11 is invalid: allowed an integer from 1 to 10"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_tokens=0 is invalid"):
        BeamSearchParams(beam_width=2, max_tokens=0)
