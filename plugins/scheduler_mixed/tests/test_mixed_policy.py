"""The ``mixed`` policy itself: decode first, chunks of any number of prompts, the chunk cap, whom it preempts,
and its options (the conformance kit checks the invariants every policy keeps)."""

from __future__ import annotations

import random

import pytest
from nanovllm_scheduler_mixed import MixedScheduler
from nanovllm_testing.conformance import SimulatedEngine, simulate_policy
from nanovllm_testing.simulated import random_tokens, tokens

from nanovllm_core import ConfigError
from nanovllm_core.engine.options import validate_options

BS = 16


def simulate(**kwargs) -> SimulatedEngine:
    return simulate_policy(MixedScheduler, **kwargs)


def test_running_requests_decode_first_then_prompts_fill_the_budget():
    sim = simulate(max_num_seqs=5)
    sim.add(tokens(20), 4, request_id="a")
    sim.add(tokens(20, 100), 4, request_id="b")
    sim.step()
    for name, n in (("c", 30), ("d", 30), ("e", 30)):
        sim.add(tokens(n, 200 + n), 4, request_id=name)
    sim.step()
    assert sim.scheduled[0] == [("a", 20), ("b", 20)]
    # a and b decode first; the 62 tokens left go to c (30), d (30) and the first 2 tokens of e
    assert sim.scheduled[1] == [("a", 1), ("b", 1), ("c", 30), ("d", 30), ("e", 2)]
    sim.run()
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


def test_a_prompt_continues_in_chunks_beside_decodes_and_new_prompts():
    sim = simulate(max_num_seqs=8, max_num_batched_tokens=32)
    sim.add(tokens(10), 6, request_id="short")
    sim.add(tokens(70, 100), 2, request_id="long")
    sim.step()
    sim.add(tokens(5, 300), 2, request_id="late")
    sim.step()
    sim.step()
    assert sim.scheduled[0] == [("short", 10), ("long", 22)]
    assert sim.scheduled[1] == [("short", 1), ("long", 31)]  # the 5-token prompt waits: no budget left
    assert sim.scheduled[2] == [("short", 1), ("long", 17), ("late", 5)]
    sim.run()
    sim.assert_outputs_exact()


def test_long_prefill_token_threshold_caps_every_chunk():
    sim = simulate(max_num_seqs=8, max_num_batched_tokens=64, scheduler_options={"long_prefill_token_threshold": 8})
    sim.add(tokens(20), 2, request_id="a")
    sim.add(tokens(20, 100), 2, request_id="b")
    sim.add(tokens(3, 200), 2, request_id="c")
    sim.run()
    assert sim.scheduled[0] == [("a", 8), ("b", 8), ("c", 3)]
    assert sim.scheduled[1] == [("a", 8), ("b", 8), ("c", 1)]
    assert sim.scheduled[2] == [("a", 4), ("b", 4)]  # c finished: its 2 tokens are sampled
    assert max(n for step in sim.scheduled for _, n in step) == 8
    sim.assert_outputs_exact()


def test_without_the_threshold_one_long_prompt_takes_the_whole_step():
    sim = simulate(max_num_seqs=8, max_num_batched_tokens=64)
    sim.add(tokens(200), 2, request_id="long")
    sim.add(tokens(3, 300), 2, request_id="short")
    sim.step()
    assert sim.scheduled[0] == [("long", 64)]


def test_preempts_the_latest_admitted_back_to_the_head_of_the_queue():
    sim = simulate(num_blocks=7, max_num_seqs=4, max_num_batched_tokens=128)
    sim.add(tokens(32), 20, request_id="a")
    sim.add(tokens(32, 100), 20, request_id="b")
    sim.add(tokens(48, 200), 20, request_id="c")
    sim.step()  # 2 + 2 + 3 blocks: the cache is full
    sim.add(tokens(4, 300), 2, request_id="d")
    sim.step()
    assert sim.scheduled[0] == [("a", 32), ("b", 32), ("c", 48)]
    # a and b each need a third block: c, the latest admitted, gives back 3 and goes back to the head of the
    # queue; one block stays free, but d, which would fit in it, waits behind c
    assert sim.preempted[1] == ["c"] and sim.scheduled[1] == [("a", 1), ("b", 1)]
    assert sim.block_manager.num_free_blocks == 1
    sim.run()
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_step_that_preempts_admits_nothing_not_even_the_victim(seed: int):
    """A prompt preempted mid-way could continue at once from its cached blocks with a small chunk: it waits for
    the next step instead (the cache is full; vLLM does the same)."""
    sim = simulate(num_blocks=8, max_num_batched_tokens=16, scheduler_options={"long_prefill_token_threshold": 8})
    rng = random.Random(seed)
    for step in range(40):
        if step % 3 == 0:
            sim.add(random_tokens(rng.randint(8, 60), rng), rng.randint(4, 20))
        if sim.core.has_unfinished_requests():
            sim.step()
    sim.run()
    assert sim.num_preemptions
    for step, (scheduled, preempted) in enumerate(zip(sim.scheduled, sim.preempted), 1):
        assert not set(preempted) & {r for r, _ in scheduled}, f"step {step} preempted {preempted} and readmitted"
    sim.assert_outputs_exact()


def test_with_priorities_the_lowest_priority_then_latest_is_preempted():
    sim = simulate(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=96)
    sim.add(tokens(32), 20, request_id="a", priority=1)
    sim.add(tokens(32, 100), 20, request_id="b", priority=5)
    sim.add(tokens(32, 200), 20, request_id="c", priority=0)
    sim.step()
    sim.step()
    assert sim.preempted[1] == ["b"]  # c was admitted last but b has the largest priority value
    assert sim.scheduled[1] == [("c", 1), ("a", 1)]  # served most urgent first
    sim.run()
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


def test_options_are_validated_naming_the_accepted_ones():
    assert validate_options("scheduler", MixedScheduler, {}) == {"long_prefill_token_threshold": 0}
    with pytest.raises(ConfigError, match="long_prefill_token_threshold") as bad_name:
        simulate(scheduler_options={"long_prefill_threshold": 8})
    assert "did you mean 'long_prefill_token_threshold'" in str(bad_name.value)
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        simulate(scheduler_options={"long_prefill_token_threshold": -1})
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        simulate(scheduler_options={"long_prefill_token_threshold": 8.5})
