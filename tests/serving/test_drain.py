"""``nanovllm serve`` as a real process, drained by a signal: new requests get 503 with Retry-After while the
requests in flight run on; a second signal aborts them, and each still ends properly (a stream with a last chunk
of finish_reason "abort" and ``data: [DONE]``, a whole response with a JSON error); no traceback, exit 0. The
engine process's start-up log reaches the server's log at the server's level."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from nanovllm_testing import write_tiny_checkpoint
from serving_helpers import assert_shut_down_cleanly, start_serve_process
from test_shutdown import free_port

LONG = 6000  # tokens: far more than the tiny model streams while the test drains (max_model_len 8192)


@pytest.fixture(scope="module")
def long_path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("drain-qwen3"), "qwen3", max_position_embeddings=8192)


def serve(path, port: int, shutdown_timeout: float, log_level: str) -> subprocess.Popen:
    cmd = [str(path), "--device", "cpu", "--max-model-len", "8192"]
    cmd += ["--kvcache-block-size", "16", "--num-kvcache-blocks", "2048"]
    cmd += ["--shutdown-timeout", str(shutdown_timeout), "--log-level", log_level]
    return start_serve_process(cmd, port)


class Stream(threading.Thread):
    """A streamed request read to its end in a thread: its chunks, whether it ended with [DONE]."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.chunks: list[dict] = []
        self.done = False
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - asserted on by the test
            self.error = exc
            self.started.set()


def test_drain_refuses_new_requests_then_aborts_the_rest_cleanly(long_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = serve(long_path, port, shutdown_timeout=60, log_level="info")
    try:
        whole: dict = {}

        def non_streaming() -> None:
            body = {"prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}
            response = httpx.post(base + "/v1/completions", json=body, timeout=60)
            whole.update(status=response.status_code, body=response.json(), headers=response.headers)

        waiting = threading.Thread(target=non_streaming, daemon=True)
        waiting.start()
        completion = Stream(base + "/v1/completions", {"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True,
                                                       "stream": True})  # fmt: skip
        chat = Stream(base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": LONG, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        })  # fmt: skip
        for stream in (completion, chat):
            stream.start()
            assert stream.started.wait(60) and stream.error is None, stream.error
        proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 10
        while refused is None and time.monotonic() < deadline:  # the drain begins within a tick of the signal
            response = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
            if response.status_code == 503:
                refused = response
            time.sleep(0.05)
        assert refused is not None, "no 503 while draining"
        assert refused.headers["retry-after"] == "1" and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(base + "/health", timeout=10).status_code == 503
        assert completion.is_alive() and chat.is_alive()  # the 60 s shutdown timeout lets them run on
        proc.send_signal(signal.SIGINT)  # a second signal: abort now
        for thread in (completion, chat, waiting):
            thread.join(30)
            assert not thread.is_alive()
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_shut_down_cleanly(proc, output)
    for stream in (completion, chat):
        assert stream.error is None and stream.done, (stream.error, stream.chunks[-2:])
        reasons = [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"]]
        assert reasons[-1] == "abort" and reasons.count("abort") == 1 and len(reasons) < LONG
    assert chat.chunks[-1]["choices"] == [] and chat.chunks[-1]["usage"]["completion_tokens"] > 0
    assert whole["status"] == 503 and whole["headers"]["retry-after"] == "1"
    assert "shut down before this request finished" in whole["body"]["error"]["message"]
    assert "shutting down: aborting" in output  # the log says what the drain did


@pytest.mark.parametrize("level", ["info", "warning"])
def test_engine_process_logs_at_the_servers_level(long_path, level):
    port = free_port()
    proc = serve(long_path, port, shutdown_timeout=0, log_level=level)
    try:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    start_up = ("KV cache: ", "start-up took ")  # logged by the engine, in its own process
    lines = [line for line in output.splitlines() if line.startswith("INFO nanovllm_core.engine")]
    if level == "info":
        assert all(any(s in line for line in lines) for s in start_up), output
    else:
        assert not any(s in output for s in start_up), output
