"""Admission control: a request body over the limit is a 413 (from Content-Length before any of it is read, or
as a chunked body passes it), a text far longer than max_model_len tokens could hold is a 400 without being
tokenized, and long texts are tokenized off the event loop: while oversized requests arrive, /health answers and
a running stream keeps going."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving_helpers import API_KEY, ENGINE, MODEL

from nanovllm_core import ConfigError
from nanovllm_core.cli import main
from nanovllm_core.serving.admission import default_max_request_body_bytes
from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.async_llm import INLINE_TOKENIZER_CHARS

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LIMIT = default_max_request_body_bytes(ENGINE["max_model_len"])


def oversized(url: str, kind: str) -> tuple[int, dict, float]:
    """One oversized request: (status, error, seconds it took)."""
    start = time.monotonic()
    headers = {**HEADERS, "content-type": "application/json"}
    if kind == "content-length":  # a body twice the limit, its size announced
        response = httpx.post(url + "/v1/completions", json={"prompt": "x" * 2 * LIMIT}, headers=HEADERS, timeout=30)
    elif kind == "chunked":  # no Content-Length: counted as it is read

        def body():
            yield b'{"prompt": "'
            for _ in range(2 * LIMIT // 65536 + 1):
                yield b"x" * 65536
            yield b'"}'

        response = httpx.post(url + "/v1/completions", content=body(), headers=headers, timeout=30)
    elif kind == "long-text":  # within the body limit, far beyond max_model_len tokens
        response = httpx.post(url + "/v1/completions", json={"prompt": "ab " * (LIMIT // 4)}, headers=HEADERS,
                              timeout=30)  # fmt: skip
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "ab " * (LIMIT // 4)}]}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
    return response.status_code, response.json()["error"], time.monotonic() - start


def test_oversized_requests_are_refused_while_health_and_a_stream_go_on(server, monkeypatch):
    tokenizer = server.engine.tokenizer
    encode, render = tokenizer.encode, tokenizer.apply_chat_template
    tokenized: list[int] = []  # the length of every text the tokenizer got
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: tokenized.append(len(text)) or encode(text, *a, **k))
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda m, *a, **k: tokenized.append(
        sum(len(x["content"]) for x in m)) or render(m, *a, **k))  # fmt: skip
    gaps: list[float] = []
    reasons: list[str | None] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                    first.set()

    running = threading.Thread(target=stream, daemon=True)
    running.start()
    assert first.wait(60)
    kinds = ["content-length"] * 3 + ["chunked"] * 3 + ["long-text"] * 2 + ["long-chat"] * 2
    health: list[tuple[int, float]] = []
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = [pool.submit(lambda kind=kind: (kind, *oversized(server.url, kind))) for kind in kinds]
        while not all(f.done() for f in futures) or len(health) < 5:  # while they arrive
            start = time.monotonic()
            health.append((httpx.get(server.url + "/health", timeout=10).status_code, time.monotonic() - start))
            time.sleep(0.01)
        results = [f.result() for f in futures]
    running.join(60)
    for kind, status, error, seconds in results:
        assert status == (413 if kind in ("content-length", "chunked") else 400), (kind, status, error)
        assert error["code"] == status and seconds < 10, (kind, error, seconds)
        assert ("--max-request-body-bytes" if status == 413 else "max_model_len") in error["message"]
    assert all(status == 200 and seconds < 1 for status, seconds in health), health
    assert reasons[-1] == "length" and max(gaps) < 1.0, max(gaps)  # loosely: no stall behind the big bodies
    assert max(tokenized) < len("ab " * (LIMIT // 4))  # the long texts were refused untokenized


def test_content_length_is_refused_before_the_body_is_sent(server):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"prompt": "')  # and nothing more of the 50 MB
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    error = json.loads(reply.split("\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "RequestTooLargeError" and "Content-Length 50000000" in error["message"]


def test_long_texts_are_tokenized_off_the_event_loop(server, monkeypatch):
    """The tokenizer's thread takes the long texts (completion prompts, chat messages, /tokenize); short ones stay
    on the event loop."""
    tokenizer = server.engine.tokenizer
    encode = tokenizer.encode
    threads: list[tuple[int, str]] = []

    def recording(text, *args, **kwargs):
        threads.append((len(text), threading.current_thread().name))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    long_text = "Hello world! " * (INLINE_TOKENIZER_CHARS // 10)
    for path, body in [
        ("/v1/completions", {"prompt": long_text, "max_tokens": 1, "truncate_prompt_tokens": 8}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}], "max_tokens": 1,
                                  "truncate_prompt_tokens": 8}),
        ("/tokenize", {"prompt": long_text}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
    ]:  # fmt: skip
        response = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=60)
        assert response.status_code == 200, response.text
    loop_thread = server.thread.name
    assert [name.startswith("nanovllm-tokenizer") for _, name in threads] == [True, True, True, False], threads
    assert threads[-1][1] == loop_thread


def test_the_body_limit_flag_is_checked():
    with pytest.raises(ConfigError, match="--max-request-body-bytes 0: at least 1"):
        ServerSettings(served_model_name="m", max_request_body_bytes=0)
    assert main(["serve", "/does/not/exist", "--max-request-body-bytes", "-5"]) == 2
