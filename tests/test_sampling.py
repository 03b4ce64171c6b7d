from __future__ import annotations

import pytest
import torch

from nanovllm_core import LLM, InvalidRequestError, SamplingParams
from nanovllm_core.layers.sampler import Sampler, SamplingBatch
from nanovllm_core.sequence import Sequence


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
        {"stop_token_ids": [-1]},
        {"seed": "x"},
    ],
)
def test_invalid_sampling_values_raise_clear_errors(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{name}=.*allowed"):
        SamplingParams(**kwargs)


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
    assert llm.check_stop(seq) == "stop"
    seq2 = Sequence([1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    seq2.append_token(eos)
    assert llm.check_stop(seq2) is None
