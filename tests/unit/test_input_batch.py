"""The runner's persistent sampling state (``engine.input_batch.InputBatch``, ``layers.sampler.SamplingState``):
slots taken when a request first samples and given back after it finished, penalty counts advanced on the device
by each step's tokens, equal to counting the sequences' tokens again."""

from __future__ import annotations

import torch

from nanovllm_core import SamplingParams
from nanovllm_core.engine.input_batch import InputBatch
from nanovllm_core.layers.sampler import Sampler, SamplingBatch
from nanovllm_core.sequence import Sequence, SequenceStatus

VOCAB = 16
CPU = torch.device("cpu")


def test_recorded_counts_equal_counts_rebuilt_from_the_tokens():
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.Generator().manual_seed(1))
    seqs = [
        Sequence([1, 2, 3], SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3)),
        Sequence([4, 4], SamplingParams(temperature=0)),
        Sequence([5], SamplingParams(temperature=0.8, repetition_penalty=1.5, seed=2)),
    ]
    inputs = InputBatch(VOCAB, CPU)
    for step in range(12):
        batch = inputs.sampling_batch(seqs)
        logits = torch.randn(len(seqs), VOCAB, generator=gen)
        rebuilt = SamplingBatch.from_seqs(seqs, VOCAB, CPU)
        assert torch.equal(batch.penalties.apply(logits), rebuilt.penalties.apply(logits)), f"step {step}"
        tokens = sampler(logits, batch)
        batch.penalties.record(tokens)
        for seq, token in zip(seqs, tokens.tolist()):
            seq.append_token(token)
    assert inputs.sampling_batch(seqs) is inputs.sampling_batch(seqs), "the same slots reuse the gathered batch"


def test_slots_and_penalty_rows_are_reused_after_a_request_finished():
    inputs = InputBatch(VOCAB, CPU)
    first = [Sequence([1], SamplingParams(presence_penalty=1.0)), Sequence([2], SamplingParams(temperature=0.5))]
    inputs.sampling_batch(first)
    assert inputs.state.penalty_rows.high == 1 and inputs.state.counts.size(0) >= 1
    for seq in first:
        seq.status = SequenceStatus.FINISHED
    second = [Sequence([3], SamplingParams(temperature=0.7, top_k=3))]
    batch = inputs.sampling_batch(second)
    assert set(inputs.slot_of) == {second[0].seq_id}
    assert inputs.state.slots.high == 2, "a freed slot is taken again"
    assert inputs.state.counts.size(0) == 0, "no request with penalties is left: the count tables are freed"
    assert torch.equal(batch.temperatures, torch.tensor([0.7])) and batch.top_k.tolist() == [3]


def test_logit_adjustments_follow_the_output_each_step():
    seq = Sequence([1], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]))
    inputs = InputBatch(VOCAB, CPU)
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    sampler = Sampler()
    picked = []
    for _ in range(3):
        picked.append(sampler(logits, inputs.sampling_batch([seq])).item())
        seq.append_token(picked[-1])
    assert 7 not in picked[:2] and picked[2] == 7, picked
