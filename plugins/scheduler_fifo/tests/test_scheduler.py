from __future__ import annotations

import pytest
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core import EngineConfig, InvalidRequestError, SamplingParams, Sequence


def make(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens_step=16, max_model_len=1024):
    config = EngineConfig(
        model="unused",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens_step,
        max_model_len=max_model_len,
        kvcache_block_size=16,
    )
    bm = PrefixCachingBlockManager(num_blocks, block_size)

    def stop(seq):
        return "length" if seq.num_completion_tokens >= seq.sampling_params.max_tokens else None

    return FifoScheduler(config, bm, stop), bm


def seq(n, max_tokens=3, start=0, rid=None):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), request_id=rid)


def run_step(sched, batch, token=1):
    sampled = [token if batch.samples(i) else None for i in range(len(batch))]
    return sched.postprocess(batch, sampled)


def run_all(sched, max_steps=1000):
    order, steps = [], 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs, "schedule returned nothing while work is pending"
        assert batch.total_new_tokens <= sched.max_num_batched_tokens
        assert len(batch.seqs) <= sched.max_num_seqs
        order += [s.request_id for s in run_step(sched, batch)]
        steps += 1
        assert steps < max_steps
    return order


def test_prefill_first_in_arrival_order_then_decode():
    sched, _ = make()
    for i in range(3):
        sched.add(seq(5, start=10 * i, rid=f"r{i}"))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1", "r2"]
    assert batch.num_new_tokens == [5, 5, 5]
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1, 1]  # pure decode step


def test_token_budget_and_only_first_sequence_is_chunked():
    sched, _ = make(max_tokens_step=16)
    sched.add(seq(10, start=0, rid="a"))
    sched.add(seq(10, start=100, rid="b"))
    batch = sched.schedule()
    # "a" fits (10), "b" would need 10 more than the 6 left: it waits, not chunked
    assert [s.request_id for s in batch.seqs] == ["a"] and batch.num_new_tokens == [10]
    run_step(sched, batch)
    sched2, _ = make(max_tokens_step=8)
    sched2.add(seq(20, rid="long"))
    chunks = []
    while sched2.waiting:
        batch = sched2.schedule()
        chunks.append(batch.num_new_tokens[0])
        assert run_step(sched2, batch) == []
    assert chunks == [8, 8, 4]


def test_max_num_seqs_respected():
    sched, _ = make(max_num_seqs=2, max_tokens_step=64)
    for i in range(5):
        sched.add(seq(3, start=i * 10))
    assert len(sched.schedule().seqs) == 2


def test_preempts_most_recent_and_everything_finishes():
    sched, bm = make(num_blocks=6, block_size=4, max_num_seqs=4, max_tokens_step=64)
    for i in range(3):
        sched.add(seq(7, max_tokens=6, start=10 * i, rid=f"r{i}"))
    order = run_all(sched)
    assert sched.num_preemptions > 0
    assert sorted(order) == ["r0", "r1", "r2"]
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequence_goes_back_to_the_head_of_the_queue():
    sched, _ = make(num_blocks=4, block_size=4, max_tokens_step=64)
    a, b = seq(8, max_tokens=8, rid="a"), seq(8, max_tokens=8, start=50, rid="b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both prefilled: 4 blocks used, none free
    batch = sched.schedule()  # a needs a 3rd block: b (most recent) is preempted
    assert [s.request_id for s in batch.preempted] == ["b"]
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0 and b.block_table == []


def test_request_that_never_fits_is_rejected_at_add():
    sched, _ = make(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="needs up to 5 KV-cache blocks .* holds 4"):
        sched.add(seq(15, max_tokens=6))
    assert not sched.has_unfinished()
    sched.add(seq(15, max_tokens=2))  # 16 tokens with KV: exactly 4 blocks


def test_abort_waiting_and_running():
    sched, bm = make()
    sched.add(seq(5, rid="a", max_tokens=10))
    sched.add(seq(5, start=20, rid="b", max_tokens=10))
    run_step(sched, sched.schedule())
    sched.add(seq(5, start=40, rid="c"))
    assert sched.abort("a").finish_reason == "abort"
    assert sched.abort("c").request_id == "c"
    assert sched.abort("zzz") is None
    assert run_all(sched) == ["b"]
    assert bm.num_free_blocks == bm.num_blocks


def test_finishing_many_sequences_keeps_running_order():
    sched, _ = make(num_blocks=256, max_num_seqs=64, max_tokens_step=1024)
    for i in range(50):
        sched.add(seq(3, max_tokens=1 + i % 5, start=i * 7, rid=str(i)))
    order = run_all(sched)
    assert sorted(order, key=int) == [str(i) for i in range(50)]
    # sequences with fewer tokens finish first; ties keep arrival order
    assert order == sorted(order, key=lambda r: (1 + int(r) % 5, int(r)))
