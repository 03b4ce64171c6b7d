"""Logprobs of sampled tokens and of prompt tokens: the engine's outputs against transformers' float32
``log_softmax`` on the tiny checkpoint (the runner's plan and the sampler's maths: unit/test_logprobs_plan.py)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from nanovllm_core import LLM, SamplingParams

BLOCK = 16


def small_llm(path, **overrides) -> LLM:
    """The tiny checkpoint on CPU in float32 (``device``, ``dtype`` and the cache sizes can be overridden)."""
    engine = dict(device="cpu", dtype="float32", kvcache_block_size=BLOCK, max_model_len=256, num_kvcache_blocks=64)
    return LLM(str(path), **{**engine, **overrides})


# --- against transformers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_log_softmax(qwen3_path):
    """log_softmax (float32) of transformers' logits at every position of a token sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32).eval()

    def run(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return run


def check_position(entry: dict, token: int, ref: torch.Tensor, num_top: int) -> None:
    """One position's dict: the chosen token with its logprob and rank, and the top ``num_top``."""
    assert token in entry
    assert entry[token].logprob == pytest.approx(ref[token].item(), abs=2e-4)
    assert entry[token].rank == 1 + int((ref > ref[token] + 1e-4).sum())
    values, ids = ref.topk(num_top)
    for value, token_id in zip(values.tolist(), ids.tolist()):
        assert token_id in entry, f"top token {token_id} missing"
        assert entry[token_id].logprob == pytest.approx(value, abs=2e-4)
    assert len(entry) <= num_top + 1


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_logprobs_match_transformers_over_chunked_prompts(qwen3_path, hf_log_softmax, async_scheduling):
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 380) for _ in range(45)]  # three chunks of the 20-token budget
    short_prompt = [rng.randrange(3, 380) for _ in range(6)]
    llm = small_llm(qwen3_path, max_num_batched_tokens=20, max_num_seqs=4, async_scheduling=async_scheduling)
    asks = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([long_prompt, short_prompt, short_prompt], [asks, plain, sampled], use_tqdm=False)

    out = outs[0]
    completion = out.outputs[0]
    ref = hf_log_softmax(long_prompt + completion.token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(long_prompt)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(long_prompt)):
        check_position(out.prompt_logprobs[p], long_prompt[p], ref[p - 1], 3)
    assert completion.logprobs is not None and len(completion.logprobs) == 8
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        check_position(entry, token, ref[len(long_prompt) + j - 1], 5)
        assert entry[token].rank == 1  # greedy
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids))
    )

    assert outs[1].outputs[0].logprobs is None and outs[1].prompt_logprobs is None
    seeded = outs[2].outputs[0]
    ref = hf_log_softmax(short_prompt + seeded.token_ids)
    for j, (token, entry) in enumerate(zip(seeded.token_ids, seeded.logprobs)):
        assert list(entry) == [token]  # logprobs=0: the sampled token only, its raw logprob (no temperature)
        assert entry[token].logprob == pytest.approx(ref[len(short_prompt) + j - 1, token].item(), abs=2e-4)
    assert all(not math.isnan(e[t].logprob) for e, t in zip(seeded.logprobs, seeded.token_ids))


def test_logprobs_leave_greedy_and_seeded_tokens_unchanged(qwen3_path):
    llm = small_llm(qwen3_path)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    base = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    ]
    with_logprobs = [dataclasses.replace(p, logprobs=4, prompt_logprobs=2) for p in base]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, base, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, with_logprobs, use_tqdm=False)]
    assert got == want


def test_prompt_logprobs_over_several_slices_with_tensor_parallel_workers(qwen3_path, hf_log_softmax):
    """A 300-token prompt is scored in two slices of logits; TP workers compute the same slices (their logits
    all-gather would hang otherwise) and the values equal TP=1's and transformers'."""
    prompt = [random.Random(9).randrange(3, 380) for _ in range(300)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    tp1 = small_llm(qwen3_path, max_model_len=512).generate([prompt], params, use_tqdm=False)[0]
    llm = small_llm(qwen3_path, max_model_len=512, tensor_parallel_size=2)
    try:
        tp2 = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    ref = hf_log_softmax(prompt)
    for p in range(1, len(prompt)):
        check_position(tp1.prompt_logprobs[p], prompt[p], ref[p - 1], 2)
        assert tp2.prompt_logprobs[p].keys() == tp1.prompt_logprobs[p].keys()
        for token, logprob in tp2.prompt_logprobs[p].items():
            assert logprob.logprob == pytest.approx(tp1.prompt_logprobs[p][token].logprob, abs=1e-4)
    assert tp2.outputs[0].token_ids == tp1.outputs[0].token_ids


def _prompt_logprobs_of(llm: LLM, prompts: list[list[int]], **params) -> list[list]:
    p = SamplingParams(temperature=0, ignore_eos=True, prompt_logprobs=1, **params)
    return [o.prompt_logprobs for o in llm.generate(prompts, p, use_tqdm=False)]



def test_prompt_logprobs_of_a_prompt_found_in_the_prefix_cache(qwen3_path):
    """vLLM scores every prompt token even when the prompt is cached: such a request must not take the cached
    prefix (the runner only has logits for the positions it computes)."""
    llm = small_llm(qwen3_path)
    prompt = [random.Random(4).randrange(3, 380) for _ in range(40)]
    first = _prompt_logprobs_of(llm, [prompt], max_tokens=2)[0]
    again = _prompt_logprobs_of(llm, [prompt], max_tokens=2)[0]
    assert len(first) == len(again) == 40
    assert [e and list(e) for e in again] == [e and list(e) for e in first]



def test_prompt_logprobs_once_per_position_when_preempted(qwen3_path):
    """A preempted sequence recomputes its prompt: the runner scores those positions again
    (``PendingStep.prompt_positions`` says where they start); the output holds each position once."""
    llm = small_llm(qwen3_path, num_kvcache_blocks=8, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(40)] for _ in range(3)]
    outs = _prompt_logprobs_of(llm, prompts, max_tokens=40)
    assert llm.stats().num_preemptions > 0
    assert [len(o) for o in outs] == [40, 40, 40]


@pytest.mark.gpu
def test_gpu_logprobs_and_penalties_match_cpu(qwen3_path):
    """On CUDA (pinned copies, one event, CUDA graphs, async scheduling beside penalised requests): greedy
    tokens, logprobs and prompt logprobs as on CPU, float32 both."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (45, 7, 20)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0, logprobs=1),
    ]

    def run(device: str) -> list:
        llm = small_llm(qwen3_path, device=device, max_num_batched_tokens=32, max_num_seqs=4)
        return llm.generate(prompts, params, use_tqdm=False)

    cpu, gpu = run("cpu"), run("cuda")
    for c, g in zip(cpu, gpu):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        for got, want in zip(g.outputs[0].logprobs or [], c.outputs[0].logprobs or []):
            assert got.keys() == want.keys()
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-3) for t in got)
        for got, want in zip((g.prompt_logprobs or [])[1:], (c.prompt_logprobs or [])[1:]):
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-3) for t in want)
    assert gpu[0].prompt_logprobs is not None and len(gpu[0].prompt_logprobs) == 45
    assert gpu[2].outputs[0].logprobs is not None and len(gpu[2].outputs[0].logprobs) == 12
