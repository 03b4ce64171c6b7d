"""Inputs that are no text or no number get a one-line named error: a lone surrogate (text decoded from non-UTF-8
bytes) is an InvalidRequestError offline and a 400 over HTTP, as are non-UTF-8 bodies and non-finite sampling
values. And two details of the OpenAI surface: chat stream chunks after the first carry no ``role`` key, and
``/openapi.json`` has one operation id per route and method."""

from __future__ import annotations

import json
import math
import warnings

import httpx
import pytest
from fastapi.openapi.utils import get_openapi
from serving_helpers import API_KEY, MODEL

from nanovllm_core import InvalidRequestError, SamplingParams
from nanovllm_core.entrypoints.chat import render_chat

HEADERS = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
LONE = b"\xff caf\xe9".decode("utf-8", errors="surrogateescape")  # latin-1 bytes read as UTF-8: lone surrogates


def test_a_lone_surrogate_is_a_named_error_offline(offline, server):
    with pytest.raises(InvalidRequestError, match=r"^the chat messages cannot be tokenized: .*lone surrogate U\+DCFF"):
        offline.chat([{"role": "user", "content": LONE}], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="lone surrogate U\\+DCFF at character 0"):
        server.engine.tokenize(LONE)
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        server.call(server.engine.add_request(LONE * 2000, SamplingParams(max_tokens=2)))  # via the tokenizer thread
    [out] = offline.generate([LONE], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.error is not None and "\n" not in out.error
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\['content'\] is bytes"):
        render_chat(offline.tokenizer, [{"role": "user", "content": b"\xff"}])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"prompt": "caf\\udce9", "max_tokens": 2}', "a \\u escape of a surrogate must be one of a pair"),
        (b'{"prompt": "caf\xe9", "max_tokens": 2}', "JSON text must be UTF-8"),
    ],
    ids=["lone-surrogate-escape", "latin-1-body"],
)
def test_text_that_is_not_unicode_is_a_400(server, raw, expected):
    response = httpx.post(server.url + "/v1/completions", content=raw, headers=HEADERS, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("the request body is not valid JSON") and expected in message and "\n" not in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "Infinity"), ("top_p", "NaN"), ("presence_penalty", "-Infinity"), ("repetition_penalty", "1e999")],
)
def test_non_finite_sampling_values_are_a_400(server, field, value):
    raw = f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 2, "{field}": {value}}}'.encode()
    response = httpx.post(server.url + "/v1/completions", content=raw, headers=HEADERS, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and "finite number" in error["message"]


@pytest.mark.parametrize(
    "values",
    [{"temperature": math.inf}, {"top_p": math.nan}, {"min_p": math.nan}, {"frequency_penalty": -math.inf},
     {"repetition_penalty": math.inf}, {"temperature": 10**400}, {"logit_bias": {3: math.nan}}],
)  # fmt: skip
def test_non_finite_sampling_params_are_rejected(values):
    [(name, value)] = values.items()
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.{name}=.* is invalid: allowed .*finite"):
        SamplingParams(**values)


def test_chat_stream_chunks_after_the_first_have_no_role(server):
    for extra in ({}, {"logprobs": True, "top_logprobs": 2}):  # the built-by-hand chunk and the model's
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "ignore_eos": True, "stream": True, **extra}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=HEADERS) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant" and len(deltas) > 2
        assert all("role" not in delta and "content" in delta for delta in deltas[1:]), deltas


def test_openapi_has_unique_operation_ids(server):
    app = server.server.config.app
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns "Duplicate Operation ID" while it builds the schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)  # built anew, not cached
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"get", "post"} <= set(schema["paths"]["/ping"])
    assert httpx.post(server.url + "/ping").status_code == httpx.get(server.url + "/ping").status_code == 200
