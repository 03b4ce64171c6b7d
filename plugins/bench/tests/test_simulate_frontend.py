"""The simulated front-end: the typical times whatever the load, or one CPU that queues every request's intake and
every step's outputs (from the front-end's CPU a request and a token, measured on an idle server)."""

from __future__ import annotations

import json

import pytest
from nanovllm_bench.serve import summarize
from nanovllm_bench.simulate import Calibration, TraceRequest, TraceSimulator
from nanovllm_bench.simulate.cost import client_from_timings
from nanovllm_bench.simulate.frontend import FixedFrontEnd, FrontEndQueue, front_end_for
from nanovllm_bench.simulate.run import client_results

COEF = {"fixed": 1.5, "per_seq": 0.002, "per_kv_token": 3e-5, "per_prompt_token": 0.002, "per_prompt_pair": 0.0}
FIXED = {"intake_ms": 0.8, "intake_ms_per_1k_prompt_tokens": 0.3, "hop_ms": 0.3, "hop_ms_per_1k_prompt_tokens": 0.1,
         "delivery_ms": 0.5}  # fmt: skip
# a request of 200 prompt tokens and one output token takes 1.4 ms of CPU, each further token 0.05 ms
CPU = {"cpu_ms_per_request": 1.4, "cpu_prompt_tokens": 200, "output_cpu_ms_per_token": 0.05}


def calibration(frontend: dict) -> Calibration:
    return Calibration(coefficients_ms=dict(COEF), num_kvcache_blocks=256, kvcache_block_size=16, frontend=frontend)


def replay(frontend: dict, requests: list[TraceRequest]):
    engine = TraceSimulator(calibration(frontend), max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512)
    return engine.replay(requests)


def test_the_queue_takes_its_costs_from_the_calibration() -> None:
    assert type(front_end_for(FIXED)) is FixedFrontEnd
    queue = front_end_for({**FIXED, **CPU})
    assert isinstance(queue, FrontEndQueue)
    assert queue.cpu_intake_s == pytest.approx(0.5e-3) and queue.cpu_intake_s_per_token == pytest.approx(0.2e-6)
    assert queue.token_s == pytest.approx(0.05e-3) and queue.back_s == pytest.approx(0.45e-3)
    # the rest of a request: 1.4 ms less its intake (0.5 + 0.2 * 0.2) and its one token
    assert queue.request_s == pytest.approx((1.4 - 0.54 - 0.05) / 1e3)


def test_a_request_alone_sees_the_same_times_through_the_queue_as_through_the_fixed_front_end() -> None:
    requests = [TraceRequest(0.0, [7] * 100, 6), TraceRequest(1.0, [8] * 300, 4)]  # the second after the first ends
    fixed = client_results(replay(FIXED, requests), FIXED)
    queued = client_results(replay({**FIXED, **CPU}, requests), {**FIXED, **CPU})
    for a, b in zip(fixed, queued):
        assert a.ok and b.ok
        assert b.ttft == pytest.approx(a.ttft) and b.latency == pytest.approx(a.latency)
        assert b.itl == pytest.approx(a.itl)


def test_a_burst_is_admitted_one_intake_after_another() -> None:
    queue = FrontEndQueue({**FIXED, **CPU})
    admitted = [queue.admit(0.0, 1000) for _ in range(4)]
    intake = 0.5e-3 + 0.2e-3  # the front-end's part of a 1,000-token prompt's intake
    hop = 0.3e-3 + 0.1e-3
    assert admitted == pytest.approx([(k + 1) * intake + hop for k in range(4)])
    assert queue.admit(1.0, 1000) == pytest.approx(1.0 + intake + hop)  # the CPU went idle meanwhile


def test_a_steps_outputs_are_delivered_one_after_another_and_a_finished_request_adds_its_rest() -> None:
    queue = FrontEndQueue({**FIXED, **CPU})
    one, two, three = [], [], []
    queue.expect(one, 1)
    queue.expect(two, 2)
    queue.expect(three, 2)
    for times in (one, two, three):
        times.append(0.010)
    queue.on_read(0.010, [one, two, three])
    token, rest, back = queue.token_s, queue.request_s, queue.back_s
    assert queue.delivered(one) == pytest.approx([0.010 + back + token])
    # ``one`` finished: its rest comes before the next request's token
    assert queue.delivered(two) == pytest.approx([0.010 + back + 2 * token + rest])
    assert queue.delivered(three) == pytest.approx([0.010 + back + 3 * token + rest])
    # a request arriving now waits for those outputs; one arriving before they came back does not
    assert queue.admit(0.0105, 0) > 0.0105 + back + 3 * token + rest


def test_near_the_front_ends_capacity_first_tokens_wait_in_its_queue() -> None:
    """Short requests at 600 a second, each taking about 1.5 ms of front-end CPU (90% of one CPU): the fixed
    front-end charges each request its typical intake, the queue makes them wait for each other."""
    requests = [TraceRequest(k / 600, [9 + k % 50] * 40, 2) for k in range(600)]
    fixed = summarize(client_results(replay(FIXED, requests), FIXED), 1.0)
    queued = summarize(client_results(replay({**FIXED, **CPU}, requests), {**FIXED, **CPU}), 1.0)
    assert queued["completed"] == fixed["completed"] == 600
    assert queued["median_ttft_ms"] > fixed["median_ttft_ms"]
    assert queued["p99_ttft_ms"] > fixed["p99_ttft_ms"] + 3.0  # at 90% busy, a few requests' worth of waiting


def test_the_cpu_probe_of_an_idle_server_becomes_the_calibrations_front_end_costs(tmp_path) -> None:
    timings = tmp_path / "idle.json"
    figures = {"long": {"prompt_tokens": 20000, "outside_server_ms": 1.2},
               "short": {"prompt_tokens": 200, "outside_server_ms": 0.8}}  # fmt: skip
    timings.write_text(json.dumps(figures))
    assert "output_cpu_ms_per_token" not in client_from_timings([str(timings)])
    probe = {"requests": 256, "prompt_tokens": 200, "output_tokens": 32, "concurrency": 16, "ms_per_request": 1.4,
             "ms_per_output_token": 0.05}  # fmt: skip
    timings.write_text(json.dumps({**figures, "frontend_cpu": probe}))
    client = client_from_timings([str(timings)])
    assert {k: client[k] for k in CPU} == CPU and client["cpu_source"] == "idle.json"
    assert isinstance(front_end_for({**FIXED, **client}), FrontEndQueue)


def test_an_idle_servers_stages_alone_fit_the_whole_front_end(tmp_path) -> None:
    """Without request timelines under load: the intake is a line through the idle stages up to the hand-over, plus
    the pipe's line; the hand-over back is the mean of the idle first tokens'."""
    from nanovllm_bench.simulate.cost import frontend_from_idle

    def stages(validated: float, handed: float, pipe: float, back: float) -> dict:
        return {"received -> validated": validated, "validated -> handed": handed, "handed -> engine_arrival": pipe,
                "first_token -> first_token_delivered": back}  # fmt: skip

    timings = tmp_path / "idle.json"
    timings.write_text(json.dumps({
        "long": {"prompt_tokens": 10200, "outside_server_ms": 1.0, "stages_ms": stages(2.3, 0.1, 0.5, 0.4)},
        "short": {"prompt_tokens": 200, "outside_server_ms": 0.8, "stages_ms": stages(0.3, 0.1, 0.3, 0.2)},
    }))  # fmt: skip
    frontend = frontend_from_idle([str(timings)])
    assert frontend["hop_ms_per_1k_prompt_tokens"] == pytest.approx(0.02)
    assert frontend["hop_ms"] == pytest.approx(0.3 - 0.2 * 0.02)
    assert frontend["intake_ms_per_1k_prompt_tokens"] == pytest.approx(0.2 + 0.02)
    assert frontend["intake_ms"] == pytest.approx(0.4 - 0.2 * 0.2 + frontend["hop_ms"])
    assert frontend["delivery_ms"] == pytest.approx(0.3) and frontend["hop_source"] == "an idle server's"


def test_a_steps_message_takes_its_cpu_before_its_tokens() -> None:
    queue = FrontEndQueue({**FIXED, **CPU, "output_cpu_ms_per_step": 0.2})
    one, two = [], []
    queue.expect(one, 3)
    queue.expect(two, 3)
    queue.on_read(0.010, [one, two])
    queue.on_read(0.0101, [one])  # back before the first message is served: it waits for it
    back, step, token = queue.back_s, 0.2e-3, queue.token_s
    first = 0.010 + back + step
    assert queue.delivered(one) == pytest.approx([first + token, first + 2 * token + step + token])
    assert queue.delivered(two) == pytest.approx([first + 2 * token])
    assert FrontEndQueue({**FIXED, **CPU, "output_cpu_ms_per_step": -0.1}).step_s == 0.0  # a noisy probe's negative
