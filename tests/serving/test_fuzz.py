"""Random request bodies (hypothesis): valid ones always succeed; with one field set to anything the answer is a 200
or an OpenAI-shaped 400/404, never a 500; a streamed 200 ends with ``data: [DONE]``; and the server is left with
nothing running and every KV block free."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}

scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3, width=32) | st.text(max_size=4)
anything = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=2)
)
unit = st.floats(0, 1)

# values the server must accept, in any combination
SAMPLING = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": unit,
    "seed": st.integers(0, 2**63),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
    "user": st.text(max_size=5),
    "unknown_field": anything,  # ignored
}
STREAM = st.one_of(
    st.fixed_dictionaries({"stream": st.just(False)}),
    st.fixed_dictionaries(
        {"stream": st.just(True)}, optional={"stream_options": st.builds(dict, include_usage=st.booleans())}
    ),
)
COMPLETION = {
    **SAMPLING,
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
}
CHAT_LOGPROBS = st.sampled_from([{}, {"logprobs": False}, {"logprobs": True}]) | st.builds(
    lambda k: {"logprobs": True, "top_logprobs": k}, st.integers(0, 5)
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=8)}),
    min_size=1,
    max_size=3,
)
completions = st.tuples(
    st.fixed_dictionaries(
        {
            "prompt": st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 383), min_size=1, max_size=6),
            "max_tokens": st.integers(1, 4),
        },
        optional=COMPLETION,
    ),
    STREAM,
).map(lambda parts: {**parts[0], **parts[1]})
chats = st.tuples(
    st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": st.integers(1, 4)}, optional=SAMPLING),
    STREAM,
    CHAT_LOGPROBS,
).map(lambda parts: {**parts[0], **parts[1], **parts[2]})
FIELDS = sorted({*COMPLETION, "prompt", "messages", "max_tokens", "stream", "stream_options", "echo", "top_logprobs"})


def check(server, path: str, body: dict, must_succeed: bool) -> None:
    with httpx.stream("POST", server.url + path, json=body, headers=HEADERS, timeout=60) as response:
        raw = response.read().decode()
    if must_succeed:
        assert response.status_code == 200, raw
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert raw.endswith("data: [DONE]\n\n") and '"error"' not in raw, raw
        return
    assert response.status_code in (400, 404), raw
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    assert error["message"]


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ENDPOINTS = [("/v1/completions", completions), ("/v1/chat/completions", chats)]


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize(("path", "bodies"), ENDPOINTS, ids=["completions", "chat"])
def test_valid_bodies_succeed(server, path, bodies, data):
    check(server, path, data.draw(bodies), must_succeed=True)


@FUZZ
@given(data=st.data(), field=st.sampled_from(FIELDS), value=anything)
@pytest.mark.parametrize(("path", "bodies"), ENDPOINTS, ids=["completions", "chat"])
def test_one_bad_field_is_a_clean_error(server, path, bodies, data, field, value):
    check(server, path, {**data.draw(bodies), field: value}, must_succeed=False)


@pytest.fixture(autouse=True, scope="module")
def _server_left_clean(server):
    yield
    stats = server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
