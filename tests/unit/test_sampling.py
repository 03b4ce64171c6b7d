"""The sampler (greedy, top-k/p, min-p, penalties) and ``SamplingParams`` validation, without a model."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import InvalidRequestError, SamplingParams
from nanovllm_core.layers.sampler import Sampler, SamplingBatch
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence


def batch_for(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    return SamplingBatch.from_seqs([Sequence([1], p) for p in params], vocab, torch.device("cpu"))


def draw(logits: torch.Tensor, params: SamplingParams, n: int = 2000) -> torch.Tensor:
    sampler = Sampler(torch.Generator().manual_seed(0))
    rows = logits.expand(n, -1)
    return sampler(rows, batch_for([params] * n, logits.size(-1)))


LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))


def test_greedy_is_argmax():
    assert draw(LOGITS, SamplingParams(temperature=0), 4).tolist() == [0] * 4


def test_top_k_keeps_only_k_most_likely():
    assert set(draw(LOGITS, SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.4 + 0.3 = 0.7 >= 0.65: tokens 0 and 1 only
    assert set(draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.65)).tolist()) == {0, 1}
    # 0.4 + 0.3 < 0.75: token 2 is needed too
    assert set(draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.75)).tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.5 * 0.4 = 0.2: tokens 0 (0.4) and 1 (0.3) stay
    assert set(draw(LOGITS, SamplingParams(temperature=1.0, min_p=0.5)).tolist()) == {0, 1}


def test_sampling_follows_distribution():
    counts = torch.bincount(draw(LOGITS, SamplingParams(temperature=1.0), 20000), minlength=5).float() / 20000
    assert torch.allclose(counts, LOGITS.exp()[0], atol=0.015)


def test_mixed_greedy_and_sampled_rows():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.log(torch.tensor([[0.1, 0.9], [0.5, 0.5]]))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    for _ in range(20):
        assert sampler(logits, batch_for(params, 2))[0].item() == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop": ""},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": 5},
        {"seed": "x"},
        {"seed": -1},
        {"seed": 2**64},
        {"temperature": True},
        {"max_tokens": True},
        {"n": 0},
        {"n": 129},
        {"n": 2.0},
        {"n": True},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": True},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": 1.0},
        {"presence_penalty": 2.5},
        {"presence_penalty": -2.1},
        {"presence_penalty": True},
        {"frequency_penalty": 3},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("inf")},
        {"repetition_penalty": False},
        {"include_stop_str_in_output": 1},
        {"priority": 1.5},
        {"priority": True},
        {"output_kind": "stream"},
    ],
    ids=repr,
)
def test_invalid_sampling_values_raise_clear_errors(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{name}=.*allowed"):
        SamplingParams(**kwargs)


def test_new_fields_accept_their_whole_range():
    for kwargs in [
        {"n": 1},
        {"n": 128},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 0},
        {"presence_penalty": -2, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"priority": -3},
        {"output_kind": "delta"},
        {"output_kind": "cumulative"},
        {"include_stop_str_in_output": True},
    ]:
        SamplingParams(**kwargs)
    defaults = SamplingParams()
    assert (defaults.n, defaults.logprobs, defaults.prompt_logprobs, defaults.priority) == (1, None, None, 0)
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty) == (0, 0, 1)
    assert defaults.output_kind == "final" and defaults.include_stop_str_in_output is False


def test_a_seed_up_to_2_pow_64_reaches_the_generator():
    seq = Sequence([1], SamplingParams(seed=2**64 - 1))
    assert seq.generator is not None and seq.generator.initial_seed() == 2**64 - 1


@pytest.mark.parametrize(
    "kwargs,needs",
    [
        ({}, False),
        ({"presence_penalty": 0.1}, True),
        ({"frequency_penalty": -1}, True),
        ({"repetition_penalty": 1.2}, True),
        ({"logprobs": 3, "temperature": 0}, False),
    ],
)
def test_needs_output_token_ids_when_a_penalty_is_on(kwargs, needs):
    assert SamplingParams(**kwargs).needs_output_token_ids is needs


# --- penalties ------------------------------------------------------------------------------------------


def reference_penalties(logits: list[float], seq: Sequence) -> list[float]:
    """vLLM's penalties written out token by token."""
    p = seq.sampling_params
    out = list(logits)
    prompt, output = seq.prompt_token_ids, seq.completion_token_ids
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def seq_with_output(prompt: list[int], output: list[int], **kwargs) -> Sequence:
    seq = Sequence(prompt, SamplingParams(**kwargs))
    for t in output:
        seq.append_token(t)
    return seq


def test_penalties_match_the_reference_and_spare_other_rows():
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    seqs = [
        seq_with_output([1, 2, 3], [4, 4, 5], temperature=0),  # no penalty
        seq_with_output([1, 2, 3, 3], [4, 4, 5, 1], repetition_penalty=1.7),
        seq_with_output([6, 7], [8, 8, 8, 9], presence_penalty=0.5, frequency_penalty=-0.25),
        seq_with_output([0, 11], [], repetition_penalty=0.6, presence_penalty=1.0),  # nothing generated yet
        seq_with_output([5], [5, 10, 10], frequency_penalty=2, repetition_penalty=1.3, temperature=0.7, seed=3),
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 3
    before = logits.clone()
    batch = SamplingBatch.from_seqs(seqs, vocab, torch.device("cpu"))
    assert batch.penalties is not None and batch.penalties.rows.tolist() == [1, 2, 3, 4]
    got = batch.penalties.apply(logits)
    assert torch.equal(logits, before), "apply must not modify its input"
    assert torch.equal(got[0], logits[0])
    for row, seq in enumerate(seqs[1:], start=1):
        want = torch.tensor(reference_penalties(logits[row].tolist(), seq))
        torch.testing.assert_close(got[row], want, msg=f"row {row}")


def test_no_penalty_means_no_penalty_tensors():
    batch = batch_for([SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=1)], 8)
    assert batch.penalties is None


def test_greedy_with_presence_penalty_avoids_generated_tokens():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]]).expand(2, -1)
    seqs = [seq_with_output([2], [0], temperature=0), seq_with_output([2], [0], temperature=0, presence_penalty=1.0)]
    tokens = sampler(logits, SamplingBatch.from_seqs(seqs, 4, torch.device("cpu")))
    assert tokens.tolist() == [0, 1]


def test_repetition_penalty_pushes_negative_logits_down():
    sampler = Sampler(torch.Generator().manual_seed(0))
    # token 0 (seen in the prompt) has the best logit but it is negative: multiplied by 2 it falls below token 1
    logits = torch.tensor([[-1.0, -1.5, -4.0]])
    seqs = [seq_with_output([0], [], temperature=0, repetition_penalty=2.0)]
    assert sampler(logits, SamplingBatch.from_seqs(seqs, 3, torch.device("cpu"))).tolist() == [1]


def test_penalties_refuse_a_token_still_in_flight():
    seq = seq_with_output([1, 2], [PLACEHOLDER_TOKEN], presence_penalty=0.5)
    with pytest.raises(AssertionError, match="in flight"):
        SamplingBatch.from_seqs([seq], 8, torch.device("cpu"))
