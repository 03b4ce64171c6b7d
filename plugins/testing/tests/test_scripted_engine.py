"""The scripted engine (no model, for measuring the serving front-end) steps as a GPU step without async
scheduling does: a request that joins a step gets its token when the step ends, ``step_s`` later, even on an idle
engine; its metrics carry the stamps a request timeline reads."""

from __future__ import annotations

import time

from nanovllm_testing.scripted import ScriptedEngine

from nanovllm_core.sampling_params import SamplingParams

STEP_S = 0.05


def test_a_request_gets_its_token_when_its_first_step_ends_and_carries_its_stamps() -> None:
    engine = ScriptedEngine("(scripted)", STEP_S, max_num_seqs=4)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), "a")
    start = time.monotonic()
    (first,) = engine.step()  # an idle engine: the step still takes its time before the token
    assert time.monotonic() - start >= STEP_S and not first.finished
    (last,) = engine.step()
    assert last.finished and last.outputs[0].finish_reason == "length"
    m = last.metrics
    assert m.arrival_time <= m.first_scheduled_time == m.prompt_scheduled_time <= m.first_token_time
    assert m.first_token_time - m.first_scheduled_time >= STEP_S
    assert m.first_token_time <= m.last_token_time == m.finished_time
    assert not engine.has_unfinished_requests() and not engine.arrivals
