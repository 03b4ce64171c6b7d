"""The ``priority`` policy itself: order, ties, preemption by priority, aging, the waiting heap and the options
(the conformance kit checks the invariants every policy keeps)."""

from __future__ import annotations

import random

import pytest
from nanovllm_scheduler_priority import PriorityScheduler
from nanovllm_testing.conformance import SimulatedEngine, simulate_policy
from nanovllm_testing.simulated import random_tokens, tokens

from nanovllm_core import ConfigError
from nanovllm_core.engine.options import validate_options


def simulate(**kwargs) -> SimulatedEngine:
    return simulate_policy(PriorityScheduler, **kwargs)


def test_lower_priority_value_first_ties_in_arrival_order():
    sim = simulate(max_num_seqs=1)
    for i, priority in enumerate((2, 0, 1, 0, 2, -1)):
        sim.add(tokens(5, 10 * i), 2, request_id=f"r{i}", priority=priority)
    sim.run()
    assert [seq.request_id for seq in sim.finished] == ["r5", "r1", "r3", "r2", "r0", "r4"]
    sim.assert_outputs_exact()


def test_decode_first_most_urgent_first_then_prompts_by_priority():
    sim = simulate(max_num_seqs=8, max_num_batched_tokens=40)
    sim.add(tokens(10), 6, request_id="low", priority=3)
    sim.add(tokens(10, 100), 6, request_id="high", priority=1)
    sim.step()
    sim.add(tokens(30, 200), 2, request_id="later-low", priority=5)
    sim.add(tokens(30, 300), 2, request_id="later-high", priority=0)
    sim.step()
    assert sim.scheduled[0] == [("high", 10), ("low", 10)]
    assert sim.scheduled[1] == [("high", 1), ("low", 1), ("later-high", 30), ("later-low", 8)]
    sim.run()
    sim.assert_outputs_exact()


def fill_the_cache(newcomer_priority: int, **kwargs) -> SimulatedEngine:
    """a and b (priority 1, 40-token prompts) hold all 6 blocks; then a 20-token request arrives."""
    sim = simulate(num_blocks=6, max_num_batched_tokens=128, **kwargs)
    sim.add(tokens(40), 8, request_id="a", priority=1)
    sim.add(tokens(40, 100), 8, request_id="b", priority=1)
    sim.step()
    assert sim.block_manager.num_free_blocks == 0
    sim.add(tokens(20, 200), 4, request_id="new", priority=newcomer_priority)
    sim.step()
    return sim


def test_a_more_urgent_request_preempts_the_least_urgent_running_one():
    sim = fill_the_cache(newcomer_priority=0)
    # b (arrived after a) was scheduled for a decode token, then gave its step and blocks to the newcomer
    assert sim.preempted[1] == ["b"] and sim.scheduled[1] == [("a", 1), ("new", 20)]
    sim.run()
    assert sim.finished[0].request_id == "new"
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


@pytest.mark.parametrize("newcomer_priority", [1, 2], ids=["equal", "less-urgent"])
def test_never_preempts_an_equally_or_more_urgent_request(newcomer_priority: int):
    sim = fill_the_cache(newcomer_priority)
    assert sim.num_preemptions == 0 and sim.scheduled[1] == [("a", 1), ("b", 1)]
    sim.run()
    assert sim.finished[-1].request_id == "new"
    sim.assert_outputs_exact()


def test_a_more_urgent_request_preempts_for_a_seat():
    sim = simulate(max_num_seqs=2)
    sim.add(tokens(10), 8, request_id="a", priority=1)
    sim.add(tokens(10, 100), 8, request_id="b", priority=2)
    sim.step()
    sim.add(tokens(10, 200), 4, request_id="new", priority=0)
    sim.step()
    assert sim.preempted[1] == ["b"] and sim.scheduled[1] == [("a", 1), ("new", 10)]
    sim.run()
    sim.assert_outputs_exact()


@pytest.mark.parametrize("gap, first", [(3, "high"), (4, "low")])
def test_aging_one_level_every_aging_steps_steps(gap: int, first: str):
    """Priority 1 arriving at step s against priority 0 arriving at step s + gap, aging_steps = 4: keys
    1 * 4 + s and 0 * 4 + s + gap; at gap 4 they tie and the earlier arrival goes first."""
    sim = simulate(max_num_seqs=1, scheduler_options={"aging_steps": 4})
    sim.add(tokens(3), 12, request_id="seat")  # holds the only seat while the others wait
    sim.step()
    sim.add(tokens(5, 100), 1, request_id="low", priority=1)
    for _ in range(gap):
        sim.step()
    sim.add(tokens(5, 200), 1, request_id="high", priority=0)
    sim.run()
    assert [seq.request_id for seq in sim.finished] == ["seat", first, "low" if first == "high" else "high"]


def stream_of_urgent_requests(aging_steps: int, steps: int) -> tuple[SimulatedEngine, bool]:
    """A priority-5 request waits while a priority-0 request arrives every step; did it finish within ``steps``?"""
    sim = simulate(max_num_seqs=2, scheduler_options={"aging_steps": aging_steps})
    for i in range(2):
        sim.add(tokens(20, 50 * i), 4, priority=0)
    low = sim.add(tokens(20, 1000), 4, request_id="low", priority=5)
    for i in range(steps):
        sim.add(tokens(20, 2000 + 7 * i), 4, priority=0)
        sim.step()
        if low.is_finished:
            break
    return sim, low.is_finished


def test_aging_lets_a_low_priority_request_through_a_stream_of_urgent_ones():
    sim, finished = stream_of_urgent_requests(aging_steps=2, steps=40)
    assert finished, "priority 5 ages to 0 in 10 steps; it must run within 40"
    sim.run()
    sim.assert_outputs_exact()


def test_without_aging_a_stream_of_urgent_requests_starves_a_low_priority_one():
    _, finished = stream_of_urgent_requests(aging_steps=0, steps=200)
    assert not finished


@pytest.mark.parametrize("arrives_at, preempts", [(1, True), (3, False)])
def test_a_newcomer_cannot_preempt_a_request_aging_lifted_above_it(arrives_at: int, preempts: bool):
    """aging_steps = 2: the running priority-1 request's key is 1 * 2 + 0 = 2; a priority-0 newcomer's is its
    arrival step. Arriving at step 1 it is more urgent and preempts; at step 3 aging has lifted the other above it."""
    sim = simulate(num_blocks=3, max_num_seqs=4, scheduler_options={"aging_steps": 2})
    running = sim.add(tokens(40), 8, request_id="running", priority=1)  # 3 blocks: the whole cache
    for _ in range(arrives_at):
        sim.step()
    sim.add(tokens(10, 100), 2, request_id="new", priority=0)
    sim.step()
    assert (running.num_preemptions == 1) is preempts
    sim.run()
    assert [seq.request_id for seq in sim.finished][0] == ("new" if preempts else "running")
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_request_preempted_in_a_step_is_not_readmitted_in_it(seed: int):
    """A prompt preempted mid-way could continue at once from its cached blocks with a small chunk: it waits for
    the next step instead of being preempted and readmitted over and over while the cache is full."""
    sim = simulate(
        num_blocks=8, max_num_batched_tokens=16,
        scheduler_options={"aging_steps": 4, "long_prefill_token_threshold": 8},
    )
    rng = random.Random(seed)
    for step in range(40):
        if step % 3 == 0:
            sim.add(random_tokens(rng.randint(8, 60), rng), rng.randint(4, 20), priority=rng.randint(0, 2))
        if sim.core.has_unfinished_requests():
            sim.step()
    sim.run()
    assert sim.num_preemptions
    for step, (scheduled, preempted) in enumerate(zip(sim.scheduled, sim.preempted), 1):
        assert not set(preempted) & {r for r, _ in scheduled}, f"step {step} preempted {preempted} and readmitted"
    sim.assert_outputs_exact()


def test_aborting_waiting_requests_keeps_the_heap_small_and_in_order():
    sim = simulate(max_num_seqs=1)
    for i in range(200):
        sim.add(tokens(4, 10 * i), 1, request_id=f"r{i}", priority=i % 3)
    for i in range(200):
        if i % 10:
            sim.abort(f"r{i}")
    scheduler = sim.scheduler
    assert scheduler.num_waiting == 20
    assert len(scheduler._heap) <= 2 * 20 + 64
    sim.run()
    order = [int(seq.request_id[1:]) for seq in sim.finished]
    assert order == sorted(order, key=lambda i: (i % 3, i))
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()
    assert not scheduler.keys, "finished requests leave no key behind"


def test_options_are_validated_naming_the_accepted_ones():
    defaults = validate_options("scheduler", PriorityScheduler, {})
    assert defaults == {"aging_steps": 1000, "long_prefill_token_threshold": 0}
    with pytest.raises(ConfigError, match="aging_steps") as bad_name:
        simulate(scheduler_options={"aging": 10})
    assert "long_prefill_token_threshold" in str(bad_name.value)
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        simulate(scheduler_options={"aging_steps": -1})
    with pytest.raises(ConfigError, match="aging_steps"):
        simulate(scheduler_options={"aging_steps": "10"})


def test_long_prefill_token_threshold_caps_every_chunk():
    sim = simulate(max_num_seqs=8, scheduler_options={"long_prefill_token_threshold": 8})
    sim.add(tokens(20), 2, request_id="a", priority=1)
    sim.add(tokens(20, 100), 2, request_id="b", priority=0)
    sim.step()
    assert sim.scheduled[0] == [("b", 8), ("a", 8)]
