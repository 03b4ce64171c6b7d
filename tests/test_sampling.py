from __future__ import annotations

import pytest
import torch

from nanovllm_core import LLM, InvalidRequestError, SamplingParams
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


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)


def test_seed_reproducible_whatever_the_batch(llm):
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate([[9, 9, 9], prompt, [4, 3]], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = (
        llm.generate(
            [prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_stop_token_ids_end_generation(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate([[10, 11, 12]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(
        [[10, 11, 12]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_at


def test_stop_strings_truncate_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([[10, 11, 12]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[8:11]
    assert len(stop) == 3
    out = llm.generate(
        [[10, 11, 12]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    assert eos in llm.eos_token_ids
    # force EOS: make it the only token allowed after sampling filters is not possible with a random model,
    # so check the stop checker directly on a sequence ending in EOS
    seq = Sequence([1, 2], SamplingParams(max_tokens=5))
    seq.append_token(eos)
    assert llm._token_stop(seq) == "stop"
    seq2 = Sequence([1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    seq2.append_token(eos)
    assert llm._token_stop(seq2) is None


def hf_greedy_with_repetition_penalty(path, prompt: list[int], max_new_tokens: int, penalty: float) -> list[int]:
    """transformers' float32 logits through its own RepetitionPenaltyLogitsProcessor, then argmax."""
    from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    process = RepetitionPenaltyLogitsProcessor(penalty)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            scores = process(ids, model(ids).logits[:, -1].float())
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_repetition_penalty_matches_transformers(qwen3_path, hf_reference, async_scheduling):
    """Greedy with a repetition penalty (over prompt and output, as transformers and vLLM apply it) gives
    transformers' tokens, beside plain greedy requests that stay as they were; with async scheduling too."""
    prompt, plain_prompt = [7, 8, 9, 7, 8, 9, 40, 41], [10, 11, 12]
    llm = LLM(
        str(qwen3_path),
        device="cpu",
        kvcache_block_size=16,
        max_model_len=256,
        num_kvcache_blocks=64,
        async_scheduling=async_scheduling,
    )
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([plain_prompt, prompt, plain_prompt], [greedy, penalised, greedy], use_tqdm=False)
    want = hf_greedy_with_repetition_penalty(qwen3_path, prompt, 24, 1.8)
    assert outs[1].outputs[0].token_ids == want
    assert want != hf_reference(qwen3_path, [prompt], 24)[0], "the penalty must change this output"
    plain = hf_reference(qwen3_path, [plain_prompt], 24)[0]
    assert outs[0].outputs[0].token_ids == plain and outs[2].outputs[0].token_ids == plain


def test_presence_penalty_stops_repeats_in_greedy_output(llm):
    prompt = [10, 11, 12]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert len(set(plain[0].outputs[0].token_ids)) < 40, "the tiny model repeats itself"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # logits of the random model stay within a few units: a penalty of 2 per repeat makes each repeat rarer
    assert len(set(out)) > len(set(plain[0].outputs[0].token_ids))
