"""Logprobs without a model: the sampler's maths (``compute_logprobs``) and the runner's plan of which prompt
tokens get a logprob in each chunk (the engine's outputs against transformers: engine/test_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import SamplingParams, SchedulerOutput
from nanovllm_core.engine.model_runner import flatten_batch, plan_prompt_logprobs
from nanovllm_core.layers.sampler import compute_logprobs
from nanovllm_core.sequence import Sequence

BLOCK = 16


def test_compute_logprobs_is_log_softmax_with_ranks_and_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    chosen = torch.tensor([3, 0, 49, 7])
    got = compute_logprobs(logits, chosen, 5)
    want = torch.log_softmax(logits.float(), dim=-1)
    for row in range(4):
        lp = want[row, chosen[row]]
        assert got.logprobs[row].item() == pytest.approx(lp.item(), abs=1e-6)
        assert got.ranks[row].item() == 1 + int((want[row] > lp).sum())
        values, ids = want[row].topk(5)
        assert got.top_ids[row].tolist() == ids.tolist()
        torch.testing.assert_close(got.top_logprobs[row], values)
    assert got.logprobs.dtype == torch.float32
    entries = got.tolist([5, 0, 2, 1])
    assert [len(e.top_ids) for e in entries] == [5, 0, 2, 1]
    assert entries[2].token_id == 49 and entries[2].top_ids == got.top_ids[2, :2].tolist()


def seq_at(tokens: list[int], num_computed: int, **params) -> Sequence:
    seq = Sequence(tokens, SamplingParams(**params))
    seq.num_computed_tokens = num_computed
    seq.block_table = list(range(-(-len(tokens) // BLOCK) + 1))
    return seq


def test_prompt_logprobs_plan_covers_every_prompt_token_over_chunks():
    prompt = list(range(100, 109))  # 9 tokens: positions 1..8 get a logprob
    covered: list[int] = []
    targets: list[int] = []
    for start, end in [(0, 5), (5, 6), (6, 9)]:
        seq = seq_at(prompt, start, prompt_logprobs=2)
        other = seq_at([1, 2, 3], 2)  # decodes beside it, asks nothing
        batch = SchedulerOutput([other, seq], [1, end - start])
        host = flatten_batch(batch, BLOCK)
        plan = plan_prompt_logprobs(batch, host)
        assert plan is not None and plan.rows == [1] and plan.num_top == [2]
        first, count = plan.first_positions[0], plan.counts[0]
        assert first == start + 1
        # the logits of flattened token q score the token after it
        assert host.prompt_logits_indices == [
            host.query_start_loc[1] + p - 1 - start for p in range(first, first + count)
        ]
        covered += range(first, first + count)
        targets += plan.targets
        assert host.logits_indices[: len(host.sample_rows)] == host.logits_indices  # sampling rows untouched
    assert covered == list(range(1, 9))
    assert targets == prompt[1:]


def test_prompt_logprobs_plan_is_none_without_requests_or_prompt_tokens():
    decode = SchedulerOutput([seq_at([1, 2, 3], 2, prompt_logprobs=1), seq_at([4, 5], 1)], [1, 1])
    assert plan_prompt_logprobs(decode, flatten_batch(decode, BLOCK)) is None
    prefill = SchedulerOutput([seq_at(list(range(10)), 0)], [10])
    host = flatten_batch(prefill, BLOCK)
    assert plan_prompt_logprobs(prefill, host) is None and host.prompt_logits_indices == []
    one_token_prompt = SchedulerOutput([seq_at([7], 0, prompt_logprobs=3)], [1])
    assert plan_prompt_logprobs(one_token_prompt, flatten_batch(one_token_prompt, BLOCK)) is None
