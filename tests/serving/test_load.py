"""Load: 500 concurrent streaming requests on 127.0.0.1, a fifth of them hanging up at random points. The server
stays up, every completed stream equals the offline greedy output, and every KV block is free afterwards.
Bounded: one minute at most, then the test fails on its own."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from serving_helpers import API_KEY, MODEL

NUM_REQUESTS = 500
MAX_TOKENS = 6
TIME_LIMIT_S = 60


def test_500_concurrent_streams_with_disconnects(server, greedy):
    rng = random.Random(0)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(4, 24))] for _ in range(20)]
    plan = [
        (prompts[i % len(prompts)], rng.randint(0, MAX_TOKENS) if i % 5 == 0 else None) for i in range(NUM_REQUESTS)
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient, prompt: list[int], hang_up_after: int | None) -> str | None:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, events = "", 0
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if hang_up_after is not None and events >= hang_up_after:
                    return None  # leaving the block closes the connection
                if line == "data: [DONE]":
                    return text
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
        raise AssertionError("the stream ended without data: [DONE]")

    async def main() -> list[str | None]:
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=TIME_LIMIT_S) as client:
            return await asyncio.gather(*(one(client, prompt, hang_up) for prompt, hang_up in plan))

    results = asyncio.run(asyncio.wait_for(main(), TIME_LIMIT_S))
    completed = [(prompt, text) for (prompt, _), text in zip(plan, results) if text is not None]
    assert len(completed) >= NUM_REQUESTS * 4 // 5
    for prompt, text in completed:
        assert text == greedy(prompt, MAX_TOKENS)[0]
    stats = server.wait_idle(timeout=15)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert httpx.get(server.url + "/health").status_code == 200
