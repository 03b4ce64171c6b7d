"""``min_tokens``, ``logit_bias`` and ``allowed_token_ids`` through the engine on the tiny checkpoint: greedy tokens
equal transformers' float32 ones with the same adjustments to its logits, beside unadjusted requests; with async
scheduling on and off."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import torch

from nanovllm_core import LLM, SamplingParams

Adjust = Callable[[int, torch.Tensor], torch.Tensor]  # (output position, float32 logits) -> adjusted logits


def hf_greedy(
    path, prompt: list[int], max_new_tokens: int, adjust: Adjust, output: list[int] | None = None
) -> list[int]:
    """transformers' float32 greedy tokens with ``adjust`` applied to each position's logits; ``output`` (if given)
    holds the tokens chosen so far while ``adjust`` runs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    output = [] if output is None else output
    with torch.no_grad():
        for position in range(max_new_tokens):
            logits = adjust(position, model(ids).logits[0, -1].float().clone())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            output.append(int(ids[0, -1]))
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(request, qwen3_path):
    return LLM(str(qwen3_path), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64,
               async_scheduling=request.param)  # fmt: skip


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **options)


def test_logit_bias_and_allowed_token_ids_match_transformers(llm, qwen3_path, hf_reference):
    prompts = [[10, 11, 12], [7, 8, 9, 40], [10, 11, 12]]
    plain = hf_reference(qwen3_path, [prompts[0]], 16)[0]
    bias = {plain[0]: -100.0, plain[3]: 1.5, 77: 2.5}  # the first greedy token ruled out, two others favoured
    allowed = [plain[2], 300, 301, 200]

    def biased(position: int, logits: torch.Tensor) -> torch.Tensor:
        for token, value in bias.items():
            logits[token] += value
        return logits

    def restricted(position: int, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = logits[allowed]
        return keep

    params = [greedy(16, ignore_eos=True, logit_bias=bias), greedy(16, ignore_eos=True, allowed_token_ids=allowed),
              greedy(16, ignore_eos=True)]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == hf_greedy(qwen3_path, prompts[0], 16, biased) and got[0][0] != plain[0]
    assert got[1] == hf_greedy(qwen3_path, prompts[1], 16, restricted) and set(got[1]) <= set(allowed)
    assert got[2] == plain, "a request without adjustments is untouched by its neighbours'"


def test_logprobs_stay_the_models_under_a_bias(llm):
    """As with the penalties, the logprobs reported are the model's, not the biased distribution's."""
    prompt = [10, 11, 12]
    plain = llm.generate([prompt], greedy(1, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    other = next(t for t in plain.logprobs[0] if t != first)
    forced = llm.generate([prompt], greedy(1, ignore_eos=True, logprobs=2, logit_bias={other: 100}),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert forced.token_ids == [other]
    assert forced.logprobs[0][other].logprob == pytest.approx(plain.logprobs[0][other].logprob, abs=1e-5)


def test_min_tokens_masks_stop_tokens_and_eos_until_reached(llm, qwen3_path, hf_reference):
    prompt = [10, 11, 12]
    plain = hf_reference(qwen3_path, [prompt], 20)[0]
    stop_at = plain[1]
    early = llm.generate([prompt], greedy(20, stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) <= 2 and early.finish_reason == "stop"
    min_tokens = 6
    stops = {stop_at, *llm.eos_token_ids}

    def held_back(position: int, logits: torch.Tensor) -> torch.Tensor:
        if position < min_tokens:
            logits[list(stops)] = float("-inf")
        return logits

    want = hf_greedy(qwen3_path, prompt, 20, held_back)
    end = next((i for i, t in enumerate(want) if i >= min_tokens and t in stops), None)
    out = llm.generate([prompt], greedy(20, stop_token_ids=[stop_at], min_tokens=min_tokens),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == (want if end is None else want[: end + 1])
    assert out.finish_reason == ("length" if end is None else "stop")
    assert not stops & set(out.token_ids[:min_tokens])


def test_min_tokens_defers_stop_strings(llm):
    """A stop string in the first ``min_tokens`` tokens' text does not end the output; one that a later token
    completes does, and the text is cut there (not at the string's first, earlier occurrence)."""
    prompt = [10, 11, 12]
    full = llm.generate([prompt], greedy(40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text[1:3]
    early = llm.generate([prompt], greedy(40, ignore_eos=True, stop=stop), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    out = llm.generate([prompt], greedy(40, ignore_eos=True, stop=stop, min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and out.token_ids == full.token_ids[: len(out.token_ids)]
    decode = llm.tokenizer.decode
    text = decode(out.token_ids)
    if out.finish_reason == "stop":
        before = decode(out.token_ids[:-1])
        assert text.rfind(stop) + len(stop) > len(before), "the last token completes the stop string"
        assert out.text == text[: text.rfind(stop)]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 40
    assert out.text.startswith(early.text) and len(out.text) > len(early.text)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 is invalid: allowed an integer from 0 to max_tokens (4)"),
        ({"min_tokens": -1}, "min_tokens=-1 is invalid"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias={'5': 1.0} is invalid: allowed None or a dict of non-negative"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias={5: nan} is invalid"),
        ({"allowed_token_ids": []}, "allowed_token_ids=[] is invalid: allowed None or a non-empty list"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids=[1, -2] is invalid"),
    ],
)
def test_bad_adjustments_name_what_is_allowed(options: dict, message: str) -> None:
    from nanovllm_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(**options)


def test_biases_are_clamped_and_the_engine_checks_token_ids(llm) -> None:
    from nanovllm_core.errors import InvalidRequestError

    assert SamplingParams(logit_bias={1: 500, 2: -1e9, 3: 0.5}).logit_bias == {1: 100.0, 2: -100.0, 3: 0.5}
    vocab = llm.vocab_size
    cases = (({"logit_bias": {vocab: 1.0}}, f"logit_bias has token ids [{vocab}]"),
             ({"allowed_token_ids": [3, vocab + 7]}, f"allowed_token_ids has token ids [{vocab + 7}]"))  # fmt: skip
    for options, message in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            llm.add_request([1, 2], SamplingParams(**options))
        assert not llm.has_unfinished_requests()
    eos = sorted(llm.eos_token_ids)
    with pytest.raises(InvalidRequestError, match="holds only EOS and stop tokens, which min_tokens=2 masks"):
        llm.add_request([1, 2], SamplingParams(min_tokens=2, allowed_token_ids=eos))
    held = SamplingParams(min_tokens=2, stop_token_ids=[9]).for_engine(frozenset(eos), vocab)
    assert held.all_stop_token_ids == {9, *eos}
    assert SamplingParams(min_tokens=2, ignore_eos=True).for_engine(frozenset(eos), vocab).all_stop_token_ids == set()


def test_bad_words_are_never_generated(llm, qwen3_path, hf_reference):
    """vLLM's bad_words: each word (and its leading-space form) as the tokenizer writes it; the last token of one is
    masked where the output ends with the others, a one-token word everywhere."""
    prompt = [10, 11, 12]
    plain = hf_reference(qwen3_path, [prompt], 16)[0]
    decode = llm.tokenizer.decode
    words = [decode(plain[1:3]), decode(plain[5:6])]
    params = greedy(16, ignore_eos=True, bad_words=words)
    encode = functools.partial(llm.tokenizer.encode, add_special_tokens=False)
    sequences = params.for_engine(llm.eos_token_ids, llm.vocab_size, encode).bad_words_token_ids
    assert sequences and all(sequences)

    def masked(position: int, logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        for word in sequences:
            before = len(word) - 1
            if before == 0 or (len(output) >= before and output[len(output) - before :] == word[:-1]):
                logits[word[-1]] = float("-inf")
        return logits

    so_far: list[int] = []
    hf = hf_greedy(qwen3_path, prompt, 16, lambda position, logits: masked(position, logits, so_far), so_far)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf and out != plain
    for word in sequences:
        assert not any(out[i : i + len(word)] == word for i in range(len(out))), word
