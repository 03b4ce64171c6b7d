"""``POST /v1/embeddings`` through the official ``openai`` client: the offline ``LLM.embed`` vectors, for a string,
a batch and token ids, as floats and as base64; the errors."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
from serving_helpers import API_KEY, MODEL

openai = pytest.importorskip("openai")


def test_embeddings_match_the_offline_engine(client, offline):
    texts = ["The quick brown fox", "jumps"]
    want = [o.embedding for o in offline.embed(texts, use_tqdm=False)]
    out = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in out.data] == [0, 1] and out.model == MODEL
    for got, expected in zip(out.data, want):
        assert got.embedding == pytest.approx(expected, abs=1e-6)
    tokens = sum(len(offline.tokenizer.encode(t)) for t in texts)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    ids = client.embeddings.create(model=MODEL, input=[5, 6, 7])
    assert ids.data[0].embedding == pytest.approx(offline.embed([[5, 6, 7]], use_tqdm=False)[0].embedding, abs=1e-6)
    # asked for explicitly, base64 comes back as the string (the client asks for it by default and decodes it)
    packed = base64.b64decode(client.embeddings.create(model=MODEL, input="jumps", encoding_format="base64")
                              .data[0].embedding)  # fmt: skip
    assert struct.unpack(f"<{len(packed) // 4}f", packed) == pytest.approx(want[1], abs=1e-6)
    floats = client.embeddings.create(model=MODEL, input="jumps", encoding_format="float").data[0].embedding
    assert floats == pytest.approx(want[1], abs=1e-6)


def test_embeddings_leave_nothing_behind(client, server):
    """Every engine request of an embeddings call finishes with it: no request, no KV block left."""
    client.embeddings.create(model=MODEL, input=["a b c"] * 5)
    stats = server.wait_idle()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_embedding_errors(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body, text in (({"input": []}, "input must not be empty"), ({"input": "x", "dimensions": 8}, "dimensions"),
                       ({"input": [1, 10**6]}, "outside the vocabulary"), ({}, "Field required")):  # fmt: skip
        response = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, headers=headers)
        assert response.status_code == 400 and text in response.json()["error"]["message"], (body, response.text)
    raw = httpx.post(server.url + "/v1/embeddings", headers=headers,
                     json={"model": MODEL, "input": "x", "encoding_format": "base64"}).json()  # fmt: skip
    vector = struct.unpack(f"<{len(base64.b64decode(raw['data'][0]['embedding'])) // 4}f",
                           base64.b64decode(raw["data"][0]["embedding"]))  # fmt: skip
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-4
