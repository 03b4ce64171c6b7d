"""Reasoning apart from the answer (vLLM's ``--reasoning-parser qwen3 | deepseek_r1``): whole replies, every way
a stream can cut them, chat responses and streams from a scripted reply (with tool calls after the thinking), and
the server's flag."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nanovllm_testing.conformance import ReasoningParserConformance
from serving_helpers import API_KEY, MODEL, ScriptedJob, pieces_of, start_server

from nanovllm_core.errors import ConfigError
from nanovllm_core.parsing.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from nanovllm_core.parsing.tool_calls import HermesToolParser
from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.openai_serving import chat_events, chat_response

QWEN3, R1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()
TEXTS = ["<think>\nThe user asks.\n</think>\n\nParis.", "  <think>x</think>y", "no thinking here",
         "<think>never closed", "<thi", "", "a</think>b", "<think>a</think>b</think>c", "\n"]  # fmt: skip


@pytest.mark.parametrize(
    "parser,text,want",
    [
        (QWEN3, TEXTS[0], ("\nThe user asks.\n", "\n\nParis.")),
        (QWEN3, TEXTS[1], ("x", "y")),
        (QWEN3, TEXTS[2], (None, TEXTS[2])),  # enable_thinking=False: the template closed an empty block
        (QWEN3, TEXTS[3], ("never closed", "")),
        (QWEN3, "<thi", (None, "<thi")),
        (QWEN3, "a</think>b", (None, "a</think>b")),
        (R1, "a</think>b", ("a", "b")),  # the template opened the block
        (R1, TEXTS[0], ("\nThe user asks.\n", "\n\nParis.")),  # a <think> written anyway is dropped
        (R1, TEXTS[2], (TEXTS[2], "")),
        (R1, "<think>a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_whole_replies(parser, text: str, want: tuple) -> None:
    assert parser.parse(text) == want


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([QWEN3, R1]), st.sampled_from(TEXTS), st.lists(st.integers(0, 100), max_size=10))
def test_a_stream_cut_anywhere_splits_as_the_whole(parser, text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream = parser.new_stream()
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    want_reasoning, want_content = parser.parse(text)
    assert (reasoning + r, content + c) == (want_reasoning or "", want_content)


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>'
REPLY = "<think>\nCheck the weather.\n</think>\n\n" + CALL


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_thinking_then_a_tool_call(size: int) -> None:
    parsers = dict(reasoning_parser=QWEN3, tool_parser=HermesToolParser())
    response = asyncio.run(chat_response(ScriptedJob(pieces_of(REPLY, size), **parsers)))
    message = response.choices[0].message
    assert message.reasoning_content == "\nCheck the weather.\n" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert response.choices[0].finish_reason == "tool_calls"

    async def events() -> list[dict]:
        job = ScriptedJob(pieces_of(REPLY, size), **parsers)
        return [json.loads(e[len("data: ") :])["choices"][0]["delta"] async for e in chat_events(job)
                if e.startswith("data: {")]  # fmt: skip

    deltas = asyncio.run(events())
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nCheck the weather.\n"
    assert "".join(d.get("content") or "" for d in deltas).strip() == ""
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["get_weather"]


def test_a_reply_without_thinking_on_a_reasoning_server(tiny_path) -> None:
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, api_key=API_KEY, reasoning_parser="qwen3"))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        answer = httpx.post(thread.url + "/v1/chat/completions", json=body, headers=headers, timeout=30).json()
        message = answer["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["content"]  # the tiny model does not think
        stream = httpx.post(thread.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                            timeout=30).text  # fmt: skip
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        assert not any("reasoning_content" in d for d in deltas)
    finally:
        thread.stop()
    with pytest.raises(ConfigError, match="no reasoning parser named 'o1' is installed; installed: deepseek_r1, qwen3"):
        ServerSettings(served_model_name=MODEL, reasoning_parser="o1")


class TestQwen3ReasoningParser(ReasoningParserConformance):
    parser_cls = Qwen3ReasoningParser
    replies = TEXTS[:4]
    expected = [("\nThe user asks.\n", "\n\nParis."), ("x", "y"), (None, TEXTS[2]), ("never closed", "")]


class TestDeepSeekR1ReasoningParser(ReasoningParserConformance):
    parser_cls = DeepSeekR1ReasoningParser
    replies = ["a</think>b", TEXTS[0], TEXTS[2]]
    expected = [("a", "b"), ("\nThe user asks.\n", "\n\nParis."), (TEXTS[2], "")]
