"""Several served model names (vLLM's ``--served-model-name A B``): clients may send any, responses carry the
first, ``/v1/models`` lists them all, and any other name is a 404 that names them."""

from __future__ import annotations

import httpx
from serving_helpers import MODEL, start_server

from nanovllm_core.serving.api_server import ServerSettings


def test_every_name_is_served_and_responses_carry_the_first(tiny_path):
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, other_model_names=("alias",)))
    try:
        listed = httpx.get(thread.url + "/v1/models").json()["data"]
        assert [card["id"] for card in listed] == [MODEL, "alias"]
        body = {"model": "alias", "prompt": "Hello", "max_tokens": 2}
        response = httpx.post(thread.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.json()["model"] == MODEL
        response = httpx.post(thread.url + "/v1/completions", json={**body, "model": "other"}, timeout=30)
        assert response.status_code == 404
        assert "this server serves 'tiny-qwen3' or 'alias'" in response.json()["error"]["message"]
    finally:
        thread.stop()
