"""``--allowed-origins`` (vLLM's flag): CORS headers for the listed origins only, preflight requests answered
before the API-key check; without the flag, no CORS headers at all."""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import API_KEY, MODEL, start_server

from nanovllm_core.errors import ConfigError
from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.serve import read_allowed_origins

ORIGIN = "http://localhost:3000"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization",
}


@pytest.fixture(scope="module")
def cors_server(tiny_path):
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, api_key=API_KEY, allowed_origins=[ORIGIN]))
    yield thread
    thread.stop()


def test_listed_origins_get_cors_headers(cors_server):
    preflight = httpx.options(cors_server.url + "/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200  # no API key needed for the browser's preflight
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    headers = {"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(cors_server.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(cors_server.url + "/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers


def test_without_the_flag_no_cors_headers(server):
    response = httpx.get(server.url + "/health", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in response.headers


def test_the_flag_takes_a_json_list():
    assert read_allowed_origins('["http://a", "*"]') == ["http://a", "*"]
    assert read_allowed_origins(None) is None
    for bad in ("http://a", '{"a": 1}', "[1]"):
        with pytest.raises(ConfigError, match="a JSON list of origins"):
            read_allowed_origins(bad)
