"""vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage``, every chunk of a stream carries the
usage so far of its choice (its prompt's tokens, the choice's completion tokens), and the last one the request's."""

from __future__ import annotations

import pytest
from serving_helpers import MODEL

openai = pytest.importorskip("openai")

OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("logprobs", [None, 1], ids=["plain", "logprobs"])
def test_completion_chunks_count_their_choices_tokens(client, offline, logprobs):
    prompts = ["The quick brown fox", "Hello world"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                            stream=True, stream_options=OPTIONS, logprobs=logprobs,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    prompt_tokens = [len(offline.tokenizer.encode(p)) for p in prompts]
    counts: list[list[int]] = [[] for _ in range(4)]  # each choice's completion_tokens, chunk by chunk
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage.prompt_tokens == prompt_tokens[choice.index // 2]
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if logprobs is not None:  # then a chunk's tokens are countable: the usage adds them up
            previous = counts[choice.index][-1] if counts[choice.index] else 0
            assert usage.completion_tokens == previous + len(choice.logprobs.tokens)
        counts[choice.index].append(usage.completion_tokens)
        if choice.finish_reason:
            assert usage.completion_tokens == 4
    # a chunk may carry more than one token (deltas that arrived together), so the counts only grow, to 4
    assert all(c == sorted(c) and 1 <= c[0] and c[-1] == 4 for c in counts)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_chunks_count_their_tokens(client):
    messages = [{"role": "user", "content": "Hello world!"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options=OPTIONS,
                                                 extra_body={"ignore_eos": True}))  # fmt: skip
    first, *middle, last = chunks
    assert first.choices[0].delta.role == "assistant" and first.usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in middle]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3
    assert all(c.usage.prompt_tokens == first.usage.prompt_tokens > 0 for c in middle)
    assert last.choices == [] and last.usage.completion_tokens == 3


def test_without_it_chunks_carry_no_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 3
