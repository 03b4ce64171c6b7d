"""``--request-timeline``: every finished request's stamps from the HTTP request to its last output, the
front-end's and the engine's in one order, written a JSON line each; the stage histograms read the same stamps.
On the CPU demo's tiny model the front-end's own part of a short request is small: a bound, not a benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from nanovllm_testing.scripts import load_script
from serving_helpers import API_KEY, MODEL, start_server
from test_vllm_metrics import by_name, scrape

from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.timeline import STAGES

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
FRONTEND_BOUND_S = 0.5  # a short prompt's HTTP request to its arrival in the engine, on an idle server


@pytest.fixture(scope="module")
def timeline_server(tiny_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("timeline") / "requests.jsonl"
    settings = ServerSettings(served_model_name=MODEL, api_key=API_KEY, request_timeline=str(path))
    thread = start_server(tiny_path, settings)
    yield thread, path
    thread.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    response = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_each_finished_request_gets_its_stamps_in_order(timeline_server) -> None:
    server, path = timeline_server
    post(server, "/v1/completions", {"prompt": "timeline one", "max_tokens": 5, "ignore_eos": True})
    post(server, "/v1/completions", {"prompt": "timeline two " * 40, "max_tokens": 3, "ignore_eos": True, "n": 2})
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
    }) as response:  # fmt: skip
        assert response.status_code == 200 and "".join(response.iter_text()).rstrip().endswith("[DONE]")
    server.wait_idle()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header, records = lines[0], lines[1:]
    assert header["clock"] == "time.monotonic" and tuple(header["stages"]) == STAGES
    assert len(records) == 3
    for record in records:
        stamps = [record[name] for name in STAGES]
        assert None not in stamps, record
        order = [name for name in STAGES if name != "finished"]  # the engine may finish after the front-end reads
        assert [record[n] for n in order] == sorted(record[n] for n in order), record
        assert record["first_token"] <= record["finished"] <= record["delivered"], record
        assert record["num_prompt_tokens"] > 0 and record["num_output_tokens"] > 0
    two = next(r for r in records if r["num_output_tokens"] == 6)  # n=2: two samples of 3 tokens
    assert two["num_prompt_tokens"] > 40
    assert all(r["engine_arrival"] - r["received"] < FRONTEND_BOUND_S for r in records), records


def test_the_stage_histograms_count_every_finished_request(timeline_server) -> None:
    server, _ = timeline_server
    before = scrape(server.url)
    post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 2, "ignore_eos": True})
    server.wait_idle()
    after = scrape(server.url)
    for name in ("nanovllm:request_frontend_time_seconds_count", "nanovllm:request_intake_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_queue_time_seconds_count"):  # fmt: skip
        grown = sum(by_name(after, name).values()) - sum(by_name(before, name).values())
        assert grown == 1, name


def test_nanovllm_serve_writes_it_with_the_engine_in_its_own_process(tiny_path, tmp_path) -> None:
    """The flag on the real command (engine process: the engine's stamps come from another process, on the same
    clock); a SIGTERM leaves whole lines."""
    import signal

    from serving_helpers import start_serve_process
    from test_shutdown import free_port

    path = tmp_path / "timeline.jsonl"
    port = free_port()
    proc = start_serve_process([str(tiny_path), "--device", "cpu", "--request-timeline", str(path),
                                "--log-level", "warning"], port)  # fmt: skip
    try:
        for i in range(2):
            body = {"prompt": f"process {i}", "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        # the benchmark that times an idle server's stages and its front-end's CPU, on the real command
        script = load_script(Path(__file__).parents[2] / "benchmarks" / "request_timeline.py")
        out = tmp_path / "idle.json"
        assert script.main(["--port", str(port), "--timeline", str(path), "--long", "48", "--short", "8", "--runs",
                            "1", "--max-token-id", "300", "--cpu-requests", "8", "--cpu-output-tokens", "3",
                            "--cpu-concurrency", "4", "--json", str(out)]) == 0  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.communicate()[0]
    figures = json.loads(out.read_text())
    assert figures["short"]["prompt_tokens"] == 8 and figures["long"]["server_ttft_ms"] > 0
    cpu = figures["frontend_cpu"]
    assert cpu["requests"] == 8 and cpu["output_tokens"] == 3
    # the three bursts' counts (the CPU figures solved from so few requests are noise, not checked)
    assert [(b["requests"], b["output_tokens"]) for b in cpu["bursts"]] == [(8, 8), (8, 24), (4, 48)]
    assert all(b["steps"] > 0 and b["cpu_s"] >= 0 for b in cpu["bursts"])
    assert cpu["bursts"][2]["steps"] >= 48  # one at a time: a step for every token
    assert all(isinstance(cpu[k], float) for k in ("ms_per_request", "ms_per_output_token", "ms_per_step"))
    # the last burst's requests alone: the engine's time from one token to the next, a step and more
    assert cpu["alone"]["requests"] == 4 and cpu["alone"]["output_tokens"] == 12
    assert cpu["alone"]["ms_per_step"] > 0
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert len(records) == 2 + 2 + 8 + 8 + 4  # this test's, the timed pair, the three bursts
    records = records[:2]
    for record in records:
        assert record["handed"] <= record["engine_arrival"] <= record["first_scheduled"] <= record["first_token"]
        assert record["first_token"] <= record["first_token_delivered"] <= record["delivered"]
