"""Property-based, on the real engine and the tiny model: greedy outputs of random request mixes with shared
prefixes, under KV pressure with async scheduling, equal the same prompts run one at a time (the simulated
engine's invariants over many more mixes: unit/test_property_scheduling.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm_core import LLM, SamplingParams

BS = 16


def prompt_of(fam: int, shared_blocks: int, tail: int, salt: int) -> list[int]:
    """``shared_blocks`` full blocks common to the family ``fam``, then ``tail`` tokens of this request's own
    (ids 3 to 382, within the tiny model's vocabulary)."""
    prefix = [(fam * 131 + i * 7) % 997 for i in range(shared_blocks * BS)]
    return [3 + t % 380 for t in prefix + [(salt * 31 + i * 13 + 5) % 997 for i in range(tail)]]


@pytest.fixture(scope="module")
def engines(qwen3_path):
    pressured = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=9,
                    max_num_seqs=4, max_num_batched_tokens=40, async_scheduling="on")
    roomy = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)
    return pressured, roomy


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 30), st.integers(1, 12)),
                         min_size=2, max_size=6))
def test_greedy_under_pressure_equals_one_at_a_time(engines, requests):
    pressured, roomy = engines
    prompts = [prompt_of(f, b, t, i) for i, (f, b, t, _) in enumerate(requests)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for *_, m in requests]
    together = pressured.generate(prompts, params, use_tqdm=False)
    alone = [roomy.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    stats = pressured.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
