"""--max-queued-requests: past the limit of requests waiting for their first token, 503 with Retry-After; the
requests already in stay untouched and the server takes new ones once the queue drains."""

from __future__ import annotations

import threading

import httpx
import pytest
from serving_helpers import start_server

from nanovllm_core.serving.api_server import ServerSettings


@pytest.fixture(scope="module")
def limited_server(tiny_path):
    thread = start_server(tiny_path, ServerSettings(served_model_name="tiny", max_queued_requests=1))
    yield thread
    thread.stop()


def test_full_queue_is_503_with_retry_after(limited_server, monkeypatch):
    url = limited_server.url + "/v1/completions"
    engine = limited_server.engine.engine
    gate = threading.Event()  # holds the step loop: an accepted request cannot get its first token
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: gate.wait(30) and step())
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url, json=body) as waiting:
            assert waiting.status_code == 200  # accepted: it waits for its first token
            full = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            error = full.json()["error"]
            assert error["code"] == 503 and "--max-queued-requests 1" in error["message"]
            gate.set()
            assert list(waiting.iter_lines())[-2] == "data: [DONE]"  # untouched by the rejection
    monkeypatch.undo()
    assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
    stats = limited_server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
