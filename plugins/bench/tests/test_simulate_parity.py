"""On one trace, the simulated engine takes the real engine's scheduling decisions on the tiny CPU model: the same
steps with the same batches (request ids and tokens scheduled), so only time is simulated."""

from __future__ import annotations

import random

import pytest
from nanovllm_bench.simulate import Calibration, TraceRequest, TraceSimulator

from nanovllm_core import SamplingParams
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore

LIMITS = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512)


def small_trace() -> list[TraceRequest]:
    rng = random.Random(11)
    t, requests = 0.0, []
    for i in range(14):
        t += rng.expovariate(400.0)
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(5, 100))]
        requests.append(TraceRequest(t, prompt, rng.randint(3, 24), i % 2, request_id=f"r{i}"))
    return requests


@pytest.mark.parametrize(
    "scheduler, blocks",
    [("fifo", 64), ("fifo", 14), ("mixed", 64), ("priority", 14)],
    ids=["fifo", "fifo-preempting", "mixed", "priority-preempting"],
)
def test_same_steps_same_batches_as_the_real_engine(qwen3_path, scheduler, blocks):
    cal = Calibration(
        coefficients_ms={"fixed": 1.0, "per_seq": 0.01, "per_kv_token": 1e-4, "per_prompt_token": 0.01},
        num_kvcache_blocks=blocks,
        kvcache_block_size=16,
    )
    sim = TraceSimulator(cal, scheduler=scheduler, record_batches=True, **LIMITS)
    times = sim.replay(small_trace())
    assert sim.steps > 20 and len({t.admitted_step for t in times}) > 3  # arrivals spread over the run

    engine = ModelEngineCore(create_engine_config(
        str(qwen3_path), kvcache_block_size=16, num_kvcache_blocks=blocks, async_scheduling="on",
        plugins={"scheduler": scheduler}, **LIMITS,
    ))
    real_batches = []
    launch = engine.step_runner.launch

    def recording_launch(batch, in_flight=None):
        real_batches.append([(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        return launch(batch, in_flight)

    engine.step_runner.launch = recording_launch
    arrivals = sorted(times, key=lambda t: t.admitted_step)
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0].admitted_step <= step:
            req = arrivals.pop(0).request
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True, priority=req.priority)
            engine.add_request(req.prompt, params, req.request_id)
        engine.step()
        step += 1
    assert step == sim.steps
    assert real_batches == sim.batches
    if blocks < 64:
        assert engine.scheduler.num_preemptions == sim.scheduler.num_preemptions > 0
