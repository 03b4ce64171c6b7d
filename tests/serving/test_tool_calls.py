"""Tool calls (vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes``): the hermes parser on whole texts and
on every way a stream can cut them, chat responses and streams built from a scripted reply, and the server's
handling of ``tools`` and ``tool_choice``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nanovllm_testing.conformance import ToolParserConformance
from serving_helpers import API_KEY, MODEL, ScriptedJob, pieces_of, start_server

from nanovllm_core.errors import ConfigError
from nanovllm_core.parsing.tool_calls import HermesToolParser
from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.openai_serving import chat_events, chat_response

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
TEXTS = [
    "Let me check.\n" + WEATHER,
    WEATHER + "\n" + TIME,
    "no call here, only <tool a tag-like <tool_cal text",
    "<tool_call>{not json}</tool_call> after",
    "started " + WEATHER[:30],  # never closed
    "",
]


def whole(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = HermesToolParser().parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_parser_splits_content_and_calls() -> None:
    assert whole(TEXTS[0]) == ("Let me check.\n", [("get_weather", {"city": "Zürich", "unit": "c"})])
    assert whole(TEXTS[1]) == (None, [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {"zone": "CET"})])
    assert whole(TEXTS[2]) == (TEXTS[2], [])
    assert whole(TEXTS[3]) == (TEXTS[3], []), "a block that is not a call stays as written"
    assert whole(TEXTS[4]) == (TEXTS[4], []), "an unclosed call stays as written"
    assert whole("") == ("", [])
    assert '"Zürich"' in HermesToolParser().parse(WEATHER).tool_calls[0].arguments  # not \\u-escaped


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_stream_cut_anywhere_parses_as_the_whole(text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream = HermesToolParser().new_stream()
    content, calls = "", []
    for a, b in zip(bounds, bounds[1:]):
        piece, new = stream.feed(text[a:b])
        content += piece
        calls += new
    rest, more = stream.finish()
    content += rest
    calls += more
    parsed = HermesToolParser().parse(text)
    assert content == (parsed.content or "") or (parsed.content is None and not content.strip())
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_chat_response_and_stream_carry_the_same_tool_calls(size: int) -> None:
    text = "Let me check.\n" + WEATHER + TIME
    response = asyncio.run(chat_response(ScriptedJob(pieces_of(text, size), tool_parser=HermesToolParser())))
    message = response.choices[0].message
    assert message.content == "Let me check.\n" and response.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {"zone": "CET"})]  # fmt: skip
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message.tool_calls)

    async def events() -> list[dict]:
        job = ScriptedJob(pieces_of(text, size), tool_parser=HermesToolParser())
        return [json.loads(e[len("data: ") :]) async for e in chat_events(job) if e.startswith("data: {")]

    chunks = asyncio.run(events())
    deltas = [c["choices"][0] for c in chunks]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me check.\n"
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all("tool_calls" not in d["delta"] for d in deltas if not d["delta"].get("tool_calls"))


def test_a_reply_without_calls_keeps_its_finish_reason() -> None:
    response = asyncio.run(chat_response(ScriptedJob(["just ", "text"], tool_parser=HermesToolParser())))
    choice = response.choices[0]
    assert choice.message.content == "just text" and choice.message.tool_calls == []
    assert choice.finish_reason == "stop"


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": CITY}}]  # fmt: skip
# the tiny template with the tools listed in a system turn, as real templates describe them
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool.function.name }}: "
    "{{ tool.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tool_server(tiny_path):
    settings = ServerSettings(served_model_name=MODEL, api_key=API_KEY, chat_template=TOOLS_TEMPLATE,
                              enable_auto_tool_choice=True, tool_call_parser="hermes")  # fmt: skip
    thread = start_server(tiny_path, settings)
    yield thread
    thread.stop()


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 4,
            "temperature": 0, **fields}  # fmt: skip
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)


def test_tools_reach_the_chat_template_and_the_reply_is_parsed(tool_server):
    tokens = httpx.post(tool_server.url + "/tokenize", headers=HEADERS, timeout=30,
                        json={"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS})
    plain = httpx.post(tool_server.url + "/tokenize", headers=HEADERS, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "weather?"}]})  # fmt: skip
    assert tokens.json()["count"] > plain.json()["count"]
    answer = chat(tool_server, tools=TOOLS)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "length"  # the tiny model calls none
    assert answer.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    # multi-turn: the assistant's tool call and the tool's answer go back to the template as they came
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "12 C"}]  # fmt: skip
    assert chat(tool_server, tools=TOOLS, messages=history).status_code == 200


def test_tool_choice_auto_needs_the_flag(server, tool_server):
    refused = chat(server, tools=TOOLS)  # the default server: no --enable-auto-tool-choice
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in refused.json()["error"]["message"]
    assert chat(server, tools=TOOLS, tool_choice="none").status_code == 200
    # "required" and a named function need no flag (structured outputs: tests/serving/test_structured_outputs_api.py)
    unknown = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    assert "tool_choice names the function 'get_time', which is not in tools" in unknown.json()["error"]["message"]
    no_tools = chat(tool_server, tool_choice="auto")
    assert no_tools.status_code == 400 and "tool_choice 'auto' needs tools" in no_tools.json()["error"]["message"]
    bad_tool = chat(tool_server, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert bad_tool.status_code == 400


def test_the_flags_are_checked_before_anything_loads() -> None:
    with pytest.raises(ConfigError, match=r"--enable-auto-tool-choice needs --tool-call-parser \(installed: hermes\)"):
        ServerSettings(served_model_name=MODEL, enable_auto_tool_choice=True)
    unknown = "--tool-call-parser 'pythonic': no tool parser named 'pythonic' is installed; installed: hermes"
    with pytest.raises(ConfigError, match=unknown):
        ServerSettings(served_model_name=MODEL, tool_call_parser="pythonic")


def test_llm_chat_gives_tools_to_the_template(tiny_path) -> None:
    from nanovllm_core import LLM, SamplingParams

    llm = LLM(str(tiny_path), kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32)
    messages = [{"role": "user", "content": "weather?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    with_tools = llm.chat(messages, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS)[0]
    without = llm.chat(messages, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE)[0]
    assert "get_weather" in llm.tokenizer.decode(with_tools.prompt_token_ids)
    assert "get_weather" not in llm.tokenizer.decode(without.prompt_token_ids)


class TestHermesToolParser(ToolParserConformance):
    parser_cls = HermesToolParser
    replies = ["Let me check.\n" + WEATHER, WEATHER + "\n" + TIME + " done"]
