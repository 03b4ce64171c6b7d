"""``echo`` on ``POST /v1/completions``, as vLLM and evaluation harnesses use it: the prompt before the
completion, its tokens' logprobs before the completion's, and ``max_tokens=0`` for the prompt alone (scoring)."""

from __future__ import annotations

import math

import httpx
import pytest
from serving_helpers import API_KEY, MODEL

from nanovllm_core import SamplingParams

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def scored(offline):
    """The offline engine's prompt logprobs of PROMPT (top 2 a position)."""
    ids = offline.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    return ids, offline.generate([ids], params, use_tqdm=False)[0].prompt_logprobs


def test_echo_puts_the_prompt_before_the_completion(client, greedy):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == PROMPT + greedy(PROMPT, 6)[0]
    assert out.usage.completion_tokens == 6


def test_echo_of_token_ids_decodes_them(client, greedy, offline):
    ids = [5, 6, 7, 8]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == offline.tokenizer.decode(ids) + greedy(ids, 3)[0]


def test_max_tokens_zero_scores_the_prompt(client, offline, scored):
    ids, expected = scored
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.tokens == [offline.tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, token, got in zip(expected[1:], ids[1:], logprobs.token_logprobs[1:]):
        assert math.isclose(got, position[token].logprob, rel_tol=1e-4, abs_tol=1e-4)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])  # the top one, and the prompt's own
    offsets = [0]
    for text in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(text))
    assert logprobs.text_offset == offsets


def test_echo_with_logprobs_continues_into_the_completion(client, scored):
    ids, _ = scored
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 4 and all(lp is not None for lp in logprobs.token_logprobs[1:])
    # the prompt's tokens spell it (an ASCII prompt: a generated token may be part of a multibyte character)
    assert "".join(logprobs.tokens[: len(ids)]) == PROMPT


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_equals_non_streamed(client, max_tokens):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_max_tokens_zero_needs_echo(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "max_tokens" and "0 needs echo=true" in error["message"]
