"""Prompts and sampling shared by the engine tests that compare runs (parity and async scheduling)."""

from __future__ import annotations

import random

from nanovllm_core import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def make_prompts(seed: int, lengths: list[int], vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


PROMPTS = make_prompts(0, [5, 17, 40, 73, 120])
