"""A client that goes away aborts its request: the KV blocks come back at once and it is counted as aborted."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
from serving_helpers import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = 450  # tokens the request would produce without the abort (max_model_len 512)


def aborted_count(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(r'nanovllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def check_aborted(server, before_aborted: float, before_tokens: int) -> None:
    stats = server.wait_idle(timeout=10)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0
    assert aborted_count(server) == before_aborted + 1
    assert stats.num_generation_tokens - before_tokens < LONG  # stopped early, not run to max_tokens


def test_streaming_disconnect_aborts(server):
    before_aborted, before_tokens = aborted_count(server), server.wait_idle().num_generation_tokens
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    # leaving the block closes the connection mid-stream
    check_aborted(server, before_aborted, before_tokens)


def test_non_streaming_disconnect_aborts(server):
    before_aborted, before_tokens = aborted_count(server), server.wait_idle().num_generation_tokens
    body = f'{{"model": "{MODEL}", "prompt": "Hello", "max_tokens": {LONG}, "ignore_eos": true}}'.encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while server.stats().num_running == 0:  # wait until it runs, then hang up
            assert time.monotonic() < deadline
            time.sleep(0.005)
    check_aborted(server, before_aborted, before_tokens)


@pytest.mark.parametrize("stream", [True, False])
def test_server_serves_on_after_disconnects(server, stream):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": stream}
    response = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200
