"""IncrementalDetokenizer: streamed pieces add up to the whole decode, each update decodes a short window."""

from __future__ import annotations

import random

from nanovllm_testing.checkpoints import build_tokenizer

from nanovllm_core.output_processor import IncrementalDetokenizer, decoder_of


def stream(decode, token_ids: list[int], start: int, windows: list[int]) -> str:
    def counting(ids: list[int], skip: bool) -> str:
        windows.append(len(ids))
        return decode(ids, skip)

    detok = IncrementalDetokenizer(counting, start, skip_special_tokens=True)
    for end in range(start + 1, len(token_ids) + 1):
        detok.update(token_ids[:end])
    return detok.text


def test_pieces_add_up_to_the_whole_text():
    tokenizer = build_tokenizer()
    decode = decoder_of(tokenizer)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog, then naïve café résumé ☃ again")
    rng = random.Random(0)
    ids += [rng.randrange(384) for _ in range(200)]  # byte pieces: characters split across tokens
    windows: list[int] = []
    assert stream(decode, ids, 3, windows) == decode(ids[3:], True)


def test_tokens_without_text_do_not_grow_the_window():
    """Ids the tokenizer does not know (a model vocabulary larger than the tokenizer's, as the benchmarks' random
    checkpoints have) and skipped special tokens decode to nothing; the window still moves on, so each update
    decodes a few tokens, not the whole completion."""
    tokenizer = build_tokenizer()
    decode = decoder_of(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    rng = random.Random(1)
    words = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    ids = tokenizer.encode("a prompt")
    ids += [rng.choice([rng.randrange(384, 150_000), eos, rng.choice(words)]) for _ in range(600)]
    windows: list[int] = []
    text = stream(decode, ids, 2, windows)
    assert text == decode(ids[2:], True)
    assert max(windows) <= 8, f"a window of {max(windows)} tokens: tokens without text kept in it"
