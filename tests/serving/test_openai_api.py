"""The server through the official ``openai`` client: completions and chat, streamed and not, n, logprobs,
usage, and the errors (401, 400 naming the field, 404, prompt over max_model_len)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from serving_helpers import API_KEY, ENGINE, MODEL

from nanovllm_core import SamplingParams
from nanovllm_core.entrypoints.chat import render_chat

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox"


def test_completion_matches_offline_greedy(client, greedy, offline):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text, ids = greedy(PROMPT, 12)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert [c.text for c in out.choices] == [text]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ids) == 12
    assert out.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_token_id_prompts_and_batches(client, greedy):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy(p, 6)[0] for p in prompts]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 12


# a greedy stream (EOS ignored) that ends with a usage chunk
GREEDY_STREAM: dict[str, Any] = dict(
    temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
)


def test_completion_streaming_equals_non_streaming(client, greedy):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY_STREAM))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(PROMPT, 12)[0]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline_chat_template(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    ids = render_chat(offline.tokenizer, messages)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY_STREAM))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_content_parts(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}],
        max_tokens=3,
        temperature=0,
    )
    assert out.choices[0].finish_reason in ("stop", "length")


def test_n_samples(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=1, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, temperature=0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] != ""


def test_completion_logprobs(client, greedy):
    _, ids = greedy(PROMPT, 5)
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, own, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert own <= 0 and len(top) == 3  # greedy: the chosen token is among the top 3
        assert top[token] == own == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0)
    tokens = text.choices[0].logprobs.tokens
    assert len(tokens) == 5 and not any(t.startswith("token_id:") for t in tokens)
    assert all(len(top) == 1 for top in text.choices[0].logprobs.top_logprobs)  # logprobs=0: the chosen one only


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)
        assert entry.bytes == list(entry.token.encode())
    assert out.choices[0].logprobs is not None
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_string_and_user_fields(client, greedy):
    text, _ = greedy(PROMPT, 12)
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("the reference text has no usable stop string")
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], user="u-1")
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.find(stop)]


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == ENGINE["max_model_len"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == httpx.post(server.url + "/ping").status_code == 200


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 401
    body = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).json()
    assert body["error"]["code"] == 401 and "Authorization: Bearer" in body["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # only /v1 needs the key


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -1, "greater than or equal to 0"),
        ("n", 0, "greater than or equal to 1"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("max_tokens", -1, "greater than or equal to 0"),  # 0 is echo's (tests/serving/test_echo.py)
        ("max_tokens", 0, "0 needs echo=true"),
        ("logprobs", 21, "less than or equal to 20"),
        ("presence_penalty", 3, "less than or equal to 2"),
        ("repetition_penalty", 0, "greater than 0"),
        ("top_k", -2, "greater than or equal to -1"),
    ],
)
def test_bad_field_is_400_naming_it(client, field, value, allowed):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={field: value})
    error = err.value.body
    assert err.value.status_code == 400
    assert error["param"] == field and field in error["message"] and allowed in error["message"]
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_bad_shapes_are_400(client, server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        ({"prompt": {"x": 1}}, "prompt", "must be a string, a list of strings"),
        ({"prompt": []}, None, "prompt must not be empty"),
        ({}, "prompt", "Field required"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None, "only allowed with stream=true"),
        ({"prompt": "x", "logit_bias": {"a1": 5}}, None, "logit_bias keys are token ids written as decimal strings"),
        ({"prompt": "x", "logit_bias": {"100000": 5}}, None, "logit_bias has token ids [100000] outside the vocab"),
        ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, None, "min_tokens=4 is invalid"),
        ({"prompt": "x", "allowed_token_ids": [1, 10**6]}, None, "allowed_token_ids has token ids [1000000]"),
        ({"prompt": "x", "bad_words": [""]}, None, "bad_words=[''] is invalid: allowed None or a list of non-empty"),
        ({"prompt": "x", "stop": [1]}, "stop", "must be a string, a list of strings, or null"),
        ({"prompt": [1, 10**6]}, None, "outside the vocabulary"),
        # structured outputs (tests/serving/test_structured_outputs_api.py has the rest)
        ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "response_format json_schema needs the schema"),
        ({"prompt": "x", "guided_choice": ["a", "b"], "guided_regex": "a"}, "guided_choice",
         "a request takes one structured-output constraint, but this one has 2: guided_regex, guided_choice"),
    ]
    for body, param, text in cases:
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, headers=headers)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] == param and text in error["message"], (body, error)
    json_headers = {**headers, "Content-Type": "application/json"}
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=json_headers)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", content=b"prompt=x", headers=headers)
    assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="one structured-output constraint, but this one has 2"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            extra_body={"guided_json": {"type": "object"}})  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                           response_format={"type": "text"})  # fmt: skip
    assert plain.choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-unknown", prompt=PROMPT, max_tokens=2)
    assert err.value.body["param"] == "model" and MODEL in err.value.body["message"]


def test_prompt_over_max_model_len_is_400(client):
    limit = ENGINE["max_model_len"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[7] * limit, max_tokens=1)
    assert f"maximum context length (max_model_len) is {limit}" in err.value.body["message"]
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[7] * 10, max_tokens=limit)
    assert err.value.body["param"] == "max_tokens" and f"at most {limit - 10}" in err.value.body["message"]
    # a good request right after still works
    assert client.completions.create(model=MODEL, prompt=[7] * 10, max_tokens=2).usage.completion_tokens >= 1


def test_chat_default_max_tokens_fills_the_context(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens + out.usage.completion_tokens == ENGINE["max_model_len"]
    assert out.choices[0].finish_reason == "length"


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "nanovllm:num_requests_running",
        "nanovllm:num_requests_waiting",
        "nanovllm:kv_cache_usage_perc",
        "nanovllm:prefix_cache_hit_rate",
        "nanovllm:prefix_cache_queries_total",
        "nanovllm:prompt_tokens_total",
        "nanovllm:generation_tokens_total",
        "nanovllm:time_to_first_token_seconds_bucket",
        "nanovllm:inter_token_latency_seconds_bucket",
        "nanovllm:e2e_request_latency_seconds_count",
        "nanovllm:request_queue_time_seconds_bucket",
        "nanovllm:request_prefill_time_seconds_bucket",
        "nanovllm:request_decode_time_seconds_bucket",
        "nanovllm:request_intake_time_seconds_bucket",
        "nanovllm:output_delivery_lag_seconds_bucket",
        "nanovllm:request_success_total",
        "nanovllm:step_loop_busy_seconds_total",
        "nanovllm:step_loop_cpu_seconds_total",
        "nanovllm:step_loop_emit_seconds_total",
        "nanovllm:cuda_graph_steps_total",
        "process_cpu_seconds_total",
    ):
        assert name in text, name
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" in line
    }
    assert values["nanovllm:generation_tokens_total"] >= 3
    assert values["nanovllm:e2e_request_latency_seconds_count"] >= 1
    # each finished request's stages, from the engine's timestamps: as many as finished requests
    for stage in ("queue", "prefill", "decode", "intake"):
        count = values[f"nanovllm:request_{stage}_time_seconds_count"]
        assert count == values["nanovllm:e2e_request_latency_seconds_count"], stage
        assert 0 <= values[f"nanovllm:request_{stage}_time_seconds_sum"] < 60 * count, stage
    assert values["nanovllm:output_delivery_lag_seconds_count"] >= 3  # one per step with outputs
    assert values["nanovllm:step_loop_steps_total"] >= 3 and values["nanovllm:step_loop_busy_seconds_total"] > 0
    assert 0 < values["nanovllm:step_loop_cpu_seconds_total"]
    assert values["nanovllm:cuda_graph_steps_total"] == 0  # a CPU engine captures no graphs
    assert 'finished_reason="length"' in text
    # the stall detectors: the engine's slow steps and longest step, the event loop's lag (a 10 ms timer)
    for over in ("0.05", "0.2", "1"):
        assert f'nanovllm:step_loop_slow_steps_total{{model_name="{MODEL}",over="{over}"}}' in text
    assert 0 < values["nanovllm:step_loop_longest_step_seconds"] < 60
    assert values["nanovllm:frontend_event_loop_lag_seconds_count"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs(server, offline, stream):
    ids = offline.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "n": 2, "stream": stream}
    response = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        with_prompt = [c for c in choices if c["prompt_logprobs"] is not None]
        assert sorted(c["index"] for c in with_prompt) == [0, 1]  # once per choice, in its first chunk
    else:
        with_prompt = response.json()["choices"]
    for choice in with_prompt:
        positions = choice["prompt_logprobs"]
        assert len(positions) == len(ids) and positions[0] is None
        for token, position in zip(ids[1:], positions[1:]):
            assert str(token) in position and 2 <= len(position) <= 3  # the prompt's token and the top 2
            assert all(entry["logprob"] <= 0 for entry in position.values())


def test_logit_bias_min_tokens_allowed_token_ids_and_bad_words_match_offline(client, offline):
    """OpenAI's logit_bias (token ids as strings) and vLLM's min_tokens, allowed_token_ids and bad_words give the
    offline engine's tokens."""
    prompt = [5, 6, 7, 8]
    plain = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    cases = [
        ({"logit_bias": {str(plain.token_ids[0]): -100, "77": 2.0}}, {"ignore_eos": True}),
        ({}, {"allowed_token_ids": [plain.token_ids[1], 200, 201], "min_tokens": 5,
              "stop_token_ids": [plain.token_ids[1]]}),
        ({}, {"bad_words": [offline.tokenizer.decode(plain.token_ids[:2])], "ignore_eos": True}),
    ]  # fmt: skip
    for native, extra in cases:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **native,
                                        extra_body=extra)  # fmt: skip
        bias = {int(k): v for k, v in native.get("logit_bias", {}).items()} or None
        want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias, **extra),
                                use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
        assert out.usage.completion_tokens == len(want.token_ids)
        assert want.token_ids != plain.token_ids


def test_truncate_prompt_tokens_lets_a_long_prompt_fit(client, greedy):
    long = [5 + i % 300 for i in range(600)]  # 600 tokens: over max_model_len=512
    out = client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 100})  # fmt: skip
    assert out.usage.prompt_tokens == 100 and out.choices[0].text == greedy(long[-100:], 4)[0]
