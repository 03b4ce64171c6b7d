"""The ``fifo`` policy's own behaviour (the conformance kit checks the invariants every policy keeps)."""

from __future__ import annotations

import random

import pytest
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager
from nanovllm_testing.simulated import SimulatedEngine, tokens

from nanovllm_core import Scheduler, SchedulerOutput

BS = 16


def make(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, **kwargs) -> SimulatedEngine:
    return SimulatedEngine(
        FifoScheduler, PrefixCachingBlockManager, num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, **kwargs,
    )


def test_prefill_first_in_arrival_order_then_decode():
    sim = make()
    for i in range(3):
        sim.add(tokens(20, 100 * i), 3, request_id=f"r{i}")
    sim.step()
    sim.step()
    assert sim.scheduled[:2] == [[("r0", 20), ("r1", 20), ("r2", 20)], [("r0", 1), ("r1", 1), ("r2", 1)]]


def test_only_the_first_prompt_of_a_step_is_chunked():
    sim = make(max_num_batched_tokens=64)
    sim.add(tokens(40), 2, request_id="a")
    sim.add(tokens(40, 100), 2, request_id="b")
    sim.step()
    # "a" fits (40); "b" would need 40 more than the 24 left: it waits, not chunked
    assert sim.scheduled[0] == [("a", 40)]
    long = make(max_num_batched_tokens=32)
    long.add(tokens(80), 1, request_id="long")
    long.run()
    assert [step[0][1] for step in long.scheduled] == [32, 32, 16]
    long.assert_outputs_exact()


def test_max_num_seqs_respected():
    sim = make(max_num_seqs=2)
    for i in range(5):
        sim.add(tokens(3, 10 * i), 2)
    sim.step()
    assert len(sim.scheduled[0]) == 2


def test_preempts_the_most_recent_and_requeues_it_at_the_head():
    sim = make(num_blocks=4)
    a = sim.add(tokens(32), 16, request_id="a")
    b = sim.add(tokens(32, 500), 16, request_id="b")
    sim.step()  # both prefilled: 4 blocks used, none free
    sim.step()  # a needs a 3rd block: b (the most recent) is preempted back to the head of the queue
    assert sim.preempted[1] == ["b"] and sim.scheduled[1] == [("a", 1)]
    assert sim.scheduler.waiting[0] is b and b.num_computed_tokens == 0 and b.block_table == []
    sim.run()
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()


def test_sequences_finish_in_length_order_keeping_arrival_order_on_ties():
    sim = make(num_blocks=256, max_num_seqs=64, max_num_batched_tokens=1024)
    for i in range(50):
        sim.add(tokens(3, 7 * i), 1 + i % 5, request_id=str(i))
    sim.run()
    order = [seq.request_id for seq in sim.finished]
    assert order == sorted(order, key=lambda r: (1 + int(r) % 5, int(r)))



class OneByOneBlockManager(PrefixCachingBlockManager):
    """Declines ``allocate_many``: the scheduler allocates one sequence at a time."""

    def allocate_many(self, seqs, num_new_tokens) -> bool:
        return False


class ChunkedDecodeFirst(Scheduler):
    """Running sequences first, prompt chunks of at most 12 tokens, so that running sequences compute chunks too."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.max_num_batched_tokens, chunk_cap=12)
        if not out.preempted:
            self.schedule_waiting(out, budget, chunk_cap=12)
        return out


@pytest.mark.parametrize("policy", [FifoScheduler, ChunkedDecodeFirst])
def test_allocating_running_sequences_at_once_decides_as_one_by_one(policy):
    def run(block_manager) -> SimulatedEngine:
        sim = SimulatedEngine(
            policy, block_manager, num_blocks=12, block_size=BS, max_num_seqs=6, max_num_batched_tokens=20
        )
        rng = random.Random(3)
        for i in range(24):
            sim.add(tokens(rng.randrange(5, 40), 100 * i), rng.randrange(1, 40), request_id=str(i))
        sim.run()
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()
        return sim

    at_once, one_by_one = run(PrefixCachingBlockManager), run(OneByOneBlockManager)
    assert one_by_one.num_preemptions > 0  # the small cache makes steps preempt
    assert at_once.scheduled == one_by_one.scheduled and at_once.preempted == one_by_one.preempted
