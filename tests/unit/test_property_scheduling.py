"""Property-based: random request mixes, aborts, KV pressure and shared prefixes keep every invariant.

The simulated engine (the real engine core, the installed fifo policy and prefix_cache block manager, a fake
model whose next token depends on the whole context) checks after every step that each context is really in
the KV cache, that used blocks are exactly the live block tables, and at the end that every output equals the
prompt's completion run alone (one-at-a-time parity) and that every block is free. The same property on the
real engine and the tiny model: engine/test_property_engine.py.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager
from nanovllm_testing.simulated import SimulatedEngine

BS = 16

family = st.integers(0, 2)
request = st.tuples(family, st.integers(0, 3), st.integers(1, 40), st.integers(1, 24))  # prefix, blocks, tail, out
event = st.one_of(st.tuples(st.just("add"), request), st.tuples(st.just("step"), st.integers(1, 4)),
                  st.tuples(st.just("abort"), st.integers(0, 1000)))


def prompt_of(fam: int, shared_blocks: int, tail: int, salt: int) -> list[int]:
    prefix = [(fam * 131 + i * 7) % 997 for i in range(shared_blocks * BS)]
    return prefix + [(salt * 31 + i * 13 + 5) % 997 for i in range(tail)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(event, min_size=1, max_size=40),
    num_blocks=st.integers(6, 24),
    budget=st.sampled_from([16, 24, 48, 128]),
    max_num_seqs=st.integers(1, 6),
    async_scheduling=st.booleans(),
)
def test_random_mixes_keep_the_invariants(events, num_blocks, budget, max_num_seqs, async_scheduling):
    sim = SimulatedEngine(
        FifoScheduler, PrefixCachingBlockManager, num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(budget, max_num_seqs), max_model_len=512, async_scheduling=async_scheduling,
    )
    for i, (kind, arg) in enumerate(events):
        if kind == "add":
            fam, blocks, tail, max_tokens = arg
            prompt = prompt_of(fam, blocks, tail, i)
            needed = -(-(len(prompt) + max_tokens - 1) // BS)
            if needed <= num_blocks:  # the engine rejects the others (checked in the kit)
                sim.add(prompt, max_tokens)
        elif kind == "step":
            for _ in range(arg):
                if sim.core.has_unfinished_requests():
                    sim.step()
        elif sim.live:
            live = sorted(sim.live)
            sim.abort(live[arg % len(live)])
    sim.run()
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()
    assert sim.core.stats().num_running == sim.core.stats().num_waiting == 0
