"""Raw HTTP: the SSE framing of streamed completions and chat (``data: <json>\\n\\n`` events, ``data: [DONE]``)."""

from __future__ import annotations

import json

import httpx
from serving_helpers import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def events(server, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", server.url + path, json=body, headers=HEADERS, timeout=60) as response:
        raw = b"".join(response.iter_raw()).decode()
    assert raw.endswith("\n\n"), raw[-50:]
    frames = raw.split("\n\n")[:-1]
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, frame
    return response, [frame[len("data: ") :] for frame in frames]


def test_completion_stream_framing(server, greedy):
    body = {
        "model": MODEL,
        "prompt": "Hello world!",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response, data = events(server, "/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == greedy("Hello world!", 8)[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert len(chunks) > 2  # incremental, not one chunk at the end


def test_chat_stream_framing_without_usage(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    _, data = events(server, "/v1/chat/completions", body)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])  # as OpenAI: the first chunk only


def test_stream_error_before_streaming_is_plain_json(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": -1, "stream": True}
    response = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["param"] == "temperature"
