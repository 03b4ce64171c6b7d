"""Structured outputs through the OpenAI API, with vLLM's request fields: ``structured_outputs``, the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, ``response_format`` and chat's
``tool_choice`` "required" or a named function (the reply constrained to tool calls).

First the request parsing (no engine): each field's StructuredOutputsParams, the 400s of bad or conflicting
values, the tool-call schemas, and how a constrained reply turns into tool calls, whole and streamed. Then the
server end to end with the xgrammar backend on the tiny random-weight checkpoint: every output follows its
constraint (schemas bound the output, so that a random model ends well within max_tokens)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest
from serving_helpers import API_KEY, MODEL, ScriptedJob, pieces_of, start_server

from nanovllm_core.cli import build_parser, cli_overrides
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.sampling_params import StructuredOutputsParams
from nanovllm_core.serving.api_server import ServerSettings
from nanovllm_core.serving.openai_serving import ForcedToolCalls, chat_events, chat_response
from nanovllm_core.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputsError,
    required_tool_calls_schema,
)


def validate(instance: Any, schema: dict) -> None:
    """``jsonschema.validate`` (the tests that check outputs against schemas skip without jsonschema)."""
    pytest.importorskip("jsonschema").validate(instance, schema)


HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "weather?"}]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99}},
    "required": ["color", "size"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Bern", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
        "additionalProperties": False, "$defs": {"zone": {"enum": ["CET", "UTC"]}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


# --- request parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        ({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, StructuredOutputsParams(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        # the backend per request: checked by the server (below), not a constraint
        ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(choice=["a"])),
    ],
)  # fmt: skip
def test_each_field_maps_to_its_structured_outputs_params(fields, expected) -> None:
    for request in (completion(**fields), chat(**fields)):
        assert request.structured_outputs_params() == expected
        params = request.sampling_params(max_tokens=8, logprobs=None)
        assert params.structured_outputs == expected


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "a request takes one structured-output "
         "constraint, but this one has 2: guided_json, guided_regex; send only one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
         "this one has 2: structured_outputs, response_format json_object"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON: "),
        ({"guided_json": "[1, 2]"}, "guided_json", "guided_json is a JSON schema: an object (or true/false)"),
        ({"guided_regex": ""}, "guided_regex", "guided_regex is a non-empty string"),
        ({"guided_choice": []}, "guided_choice", "guided_choice is a non-empty list of non-empty strings"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice is a non-empty list of non-empty strings"),
        ({"guided_grammar": ""}, "guided_grammar", "guided_grammar is a non-empty string"),
        ({"structured_outputs": {}}, "structured_outputs",
         "structured_outputs takes exactly one of json, regex, choice, grammar or json_object=True; got none"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "got json, regex"),
        ({"structured_outputs": {"choice": "ab"}}, "structured_outputs",
         "structured_outputs.choice is a non-empty list of non-empty strings"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
         "structured_outputs.structural_tag is not supported; structured_outputs takes json, regex, choice, grammar, "
         "json_object, disable_any_whitespace, disable_fallback"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "structured_outputs",
         "structured_outputs.disable_any_whitespace is true or false"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         'response_format json_schema needs the schema: {"type": "json_schema", "json_schema": {"name": ..., '
         '"schema": {...}}}'),
        ({"response_format": {"type": "json_schema"}}, "response_format",
         "response_format json_schema needs the schema"),
    ],
)  # fmt: skip
def test_bad_or_conflicting_constraints_are_errors_naming_the_field(fields, param, message) -> None:
    for request in (completion(**fields), chat(**fields)):
        with pytest.raises(StructuredOutputsError) as err:
            request.sampling_params(max_tokens=8, logprobs=None)
        assert err.value.param == param and message in str(err.value) and "\n" not in str(err.value)
        assert isinstance(err.value, InvalidRequestError)


def test_tool_choice_required_is_a_json_array_of_calls_of_the_tools() -> None:
    request = chat(tools=TOOLS, tool_choice="required")
    params = request.structured_outputs_params()
    assert params is not None and params.json == required_tool_calls_schema(request.tools)  # type: ignore[arg-type]
    schema = params.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}]  # fmt: skip
    assert schema["$defs"] == TIME["$defs"], "each tool's $defs move to the top, where its $refs resolve"
    assert "$defs" in TOOLS[1]["function"]["parameters"] and "$defs" in request.tools[1].function.parameters
    good = [{"name": "get_weather", "parameters": {"city": "Bern", "unit": "c"}},
            {"name": "get_time", "parameters": {"zone": "UTC"}}]  # fmt: skip
    validate(good, schema)
    bad_replies = (
        [],
        [{"name": "get_weather", "parameters": {"zone": "UTC"}}],
        [{"name": "get_time", "parameters": {"zone": "PST"}}],
        [{"name": "other", "parameters": {}}],
    )
    for bad in bad_replies:
        with pytest.raises(pytest.importorskip("jsonschema").ValidationError):
            validate(bad, schema)
    one = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).structured_outputs_params()
    assert one is not None and one.json["maxItems"] == 1  # type: ignore[index]
    # a tool without parameters takes an empty object, as vLLM's
    bare = chat(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required")
    item = bare.structured_outputs_params().json["items"]["anyOf"][0]  # type: ignore[union-attr,index]
    assert item["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_tools_whose_defs_differ_cannot_be_required() -> None:
    other = {**TIME, "$defs": {"zone": {"enum": ["PST"]}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time_too", "parameters": other}}]
    with pytest.raises(StructuredOutputsError, match="the \"\\$defs\" entry 'zone' differs between tools") as err:
        chat(tools=tools, tool_choice="required").structured_outputs_params()
    assert err.value.param == "tools"


def test_a_named_function_constrains_the_reply_to_its_parameters() -> None:
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert request.named_tool == "get_time" and request.forces_tool_calls and not request.parses_tool_calls
    assert request.structured_outputs_params() == StructuredOutputsParams(json=TIME)
    unknown = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(StructuredOutputsError) as err:
        unknown.structured_outputs_params()
    assert err.value.param == "tool_choice"
    assert str(err.value) == (
        "tool_choice names the function 'get_date', which is not in tools (they are 'get_weather', 'get_time')"
    )
    with pytest.raises(StructuredOutputsError, match="this one has 2: guided_regex, tool_choice function"):
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
             guided_regex="a").structured_outputs_params()  # fmt: skip
    assert chat(tools=TOOLS, tool_choice="none").structured_outputs_params() is None
    assert chat(tools=TOOLS, tool_choice="auto").structured_outputs_params() is None


def test_the_engines_errors_name_the_field_the_constraint_came_in() -> None:
    invalid = InvalidRequestError('structured_outputs.json is invalid (xgrammar): Unsupported type "x"')
    cases = [
        (completion(guided_json={"type": "x"}), "guided_json", "guided_json is invalid (xgrammar)"),
        (completion(structured_outputs={"json": {"type": "x"}}), "structured_outputs",
         "structured_outputs.json is invalid (xgrammar)"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "x"}}}),
         "response_format", "response_format.json_schema.schema is invalid (xgrammar)"),
        (chat(tools=TOOLS, tool_choice="required"), "tool_choice",
         "tool_choice's schema (made of the tools' parameters) is invalid (xgrammar)"),
    ]  # fmt: skip
    for request, param, message in cases:
        error = request.engine_error(invalid)
        assert isinstance(error, StructuredOutputsError) and error.param == param
        assert str(error) == message + ': Unsupported type "x"'
    none = InvalidRequestError("structured_outputs needs a structured-output backend and none is installed; pip ...")
    assert str(completion(guided_regex="a").engine_error(none)).startswith("guided_regex needs a structured-output")
    other = InvalidRequestError("the prompt is too long")
    assert completion(guided_regex="a").engine_error(other) is other
    assert completion().engine_error(invalid) is invalid


def test_the_serve_flag_sets_the_backend() -> None:
    parser = build_parser()
    for flag in ("--structured-outputs-backend", "--guided-decoding-backend"):
        args = parser.parse_args(["serve", "--demo", flag, "guidance"])
        assert cli_overrides(args)["plugins"] == {"structured_output_backend": "guidance"}
    assert "plugins" not in cli_overrides(parser.parse_args(["serve", "--demo"]))


# --- constrained replies as tool calls -----------------------------------------------------------------

REQUIRED_REPLY = '[{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}, {"name": "get_time", ' \
                 '"parameters": {"zone": "CET"}}]'  # fmt: skip
CALLS = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {"zone": "CET"})]


def stream_chunks(job: ScriptedJob) -> list[dict]:
    async def events() -> list[dict]:
        return [json.loads(e[len("data: ") :]) async for e in chat_events(job) if e.startswith("data: {")]

    return [chunk["choices"][0] for chunk in asyncio.run(events()) if chunk["choices"]]


def streamed_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    """The calls of a stream as a client assembles them: by index, the first delta's id and name, the arguments
    joined."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta["delta"].get("tool_calls", []):
            if call["index"] not in calls:
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function", call
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}, call
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_required_reply_is_its_tool_calls(size: int) -> None:
    forced = ForcedToolCalls()
    response = asyncio.run(chat_response(ScriptedJob(pieces_of(REQUIRED_REPLY, size), forced_tool_calls=forced)))
    choice = response.choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert '"Zürich"' in choice.message.tool_calls[0].function.arguments  # not \u-escaped
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls)
    deltas = stream_chunks(ScriptedJob(pieces_of(REQUIRED_REPLY, size), forced_tool_calls=forced))
    assert streamed_calls(deltas) == CALLS
    assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["delta"]["content"] is None
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""


def test_a_required_reply_cut_short_stays_text() -> None:
    cut = REQUIRED_REPLY[:40]
    choice = asyncio.run(chat_response(ScriptedJob([cut], forced_tool_calls=ForcedToolCalls()))).choices[0]
    assert choice.message.content == cut and choice.message.tool_calls == [] and choice.finish_reason == "stop"
    deltas = stream_chunks(ScriptedJob(pieces_of(cut, 7), forced_tool_calls=ForcedToolCalls()))
    assert "".join(d["delta"].get("content") or "" for d in deltas) == cut
    assert not any(d["delta"].get("tool_calls") for d in deltas) and deltas[-1]["finish_reason"] == "stop"
    assert ForcedToolCalls().parse('[{"name": "a"}]') is None, "a call without parameters is not a call"
    assert ForcedToolCalls().parse("[]") is None


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_named_functions_reply_is_its_arguments(size: int) -> None:
    arguments = '{"zone": "CET"}'
    forced = ForcedToolCalls("get_time")
    choice = asyncio.run(chat_response(ScriptedJob(pieces_of(arguments, size), forced_tool_calls=forced))).choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's and vLLM's
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_time", arguments)]
    deltas = stream_chunks(ScriptedJob(pieces_of(arguments, size), forced_tool_calls=forced))
    assert streamed_calls(deltas) == [("get_time", {"zone": "CET"})]
    with_calls = [d for d in deltas if d["delta"].get("tool_calls")]
    assert len(with_calls) == len(pieces_of(arguments, size)), "the arguments stream as they come"
    assert deltas[-1]["finish_reason"] == "stop"


# --- the server ----------------------------------------------------------------------------------------


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=60)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": "x", "guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice",
         "a request takes one structured-output constraint, but this one has 2: guided_json, guided_choice"),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice",
         "guided_choice is a non-empty list of non-empty strings"),
        ("/v1/completions", {"prompt": "x", "guided_json": 5}, "guided_json",
         "guided_json: must be a JSON schema: an object, or its JSON text"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format",
         "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format",
         "response_format json_schema needs the schema"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema",
         "json_schema": {"schema": SCHEMA}}}, "response_format", "response_format.json_schema.name: Field required"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function"}},
         "tool_choice", 'tool_choice: must be "none", "auto", "required", or {"type": "function", "function"'),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function",
         "function": {"name": "nope"}}}, "tool_choice", "tool_choice names the function 'nope', which is not in tools"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, None,
         "tool_choice 'required' needs tools"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
         "response_format": {"type": "json_object"}}, "tool_choice",
         "this one has 2: response_format json_object, tool_choice required"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_400_naming_the_field(server, path, body, param, message) -> None:
    for stream in (False, True):  # a 400 before any stream starts
        response = post(server, path, {**body, "stream": stream, "max_tokens": 4})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["param"] == param and message in error["message"], error


# --- end to end, with a backend ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def so_server(tiny_path):
    pytest.importorskip("nanovllm_structured_xgrammar")
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, api_key=API_KEY),
                          plugins={"structured_output_backend": "xgrammar"})  # fmt: skip
    yield thread
    thread.stop()


@pytest.fixture
def so_client(so_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=so_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def stream_text(chunks: Any) -> tuple[str, str | None]:
    """A completion stream's text and last finish_reason."""
    text, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


def test_choice_and_regex_outputs_follow_them(so_client) -> None:
    choices = ["yes", "no", "maybe"]
    for seed in range(3):
        out = so_client.completions.create(model=MODEL, prompt="Is it?", max_tokens=50, seed=seed, n=2,
                                           extra_body={"guided_choice": choices})  # fmt: skip
        assert [c.text for c in out.choices if c.text in choices] == [c.text for c in out.choices]
        assert {c.finish_reason for c in out.choices} == {"stop"}
    text, finish = stream_text(so_client.completions.create(
        model=MODEL, prompt="Is it?", max_tokens=50, stream=True, extra_body={"structured_outputs": {"choice": choices}}
    ))  # fmt: skip
    assert text in choices and finish == "stop"
    regex = r"[a-c]{2,4}-\d{2}"
    out = so_client.completions.create(model=MODEL, prompt="Code:", max_tokens=50, seed=1,
                                       extra_body={"guided_regex": regex})  # fmt: skip
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    text, finish = stream_text(so_client.completions.create(model=MODEL, prompt="Code:", max_tokens=50, stream=True,
                                                            extra_body={"guided_regex": regex}))  # fmt: skip
    assert re.fullmatch(regex, text) and finish == "stop"
    chat = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50,
                                             extra_body={"guided_choice": choices})  # fmt: skip
    assert chat.choices[0].message.content in choices


def test_json_schema_output_validates(so_client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        out = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, seed=seed,
                                                response_format=response_format)  # fmt: skip
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        validate(json.loads(out.choices[0].message.content), SCHEMA)
    chunks = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, stream=True,
                                               response_format=response_format)  # fmt: skip
    text, finish = "", None
    for chunk in chunks:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    validate(json.loads(text), SCHEMA)
    any_object = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, seed=2,
                                                   response_format={"type": "json_object"})  # fmt: skip
    if any_object.choices[0].finish_reason == "stop":  # any object: a random model may write a long one
        assert isinstance(json.loads(any_object.choices[0].message.content), dict)


def test_disable_any_whitespace_gives_compact_json(so_client) -> None:
    """vLLM's ``structured_outputs.disable_any_whitespace``: JSON without optional whitespace (xgrammar writes it
    as Python's json.dumps does)."""
    for seed in range(3):
        out = so_client.completions.create(model=MODEL, prompt="{", max_tokens=200, seed=seed, extra_body={
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})  # fmt: skip
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
        validate(json.loads(text), SCHEMA)
        assert text == json.dumps(json.loads(text)), f"not compact: {text!r}"


def assert_calls_validate(calls: list, tools: list[dict]) -> None:
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        validate(json.loads(call.function.arguments), parameters[call.function.name])


def test_tool_choice_required_gives_tool_calls(so_client) -> None:
    for seed in range(3):
        out = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, seed=seed,
                                                tools=TOOLS, tool_choice="required")  # fmt: skip
        choice = out.choices[0]
        if choice.finish_reason == "length":  # more calls than max_tokens hold (a random model may go on)
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_calls_validate(choice.message.tool_calls, TOOLS)
    one = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    assert_calls_validate(one.choices[0].message.tool_calls, TOOLS)
    with so_client.beta.chat.completions.stream(
        model=MODEL, messages=MESSAGES, max_tokens=200, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_calls_validate(final.choices[0].message.tool_calls, TOOLS)


def test_a_named_function_gives_one_call_to_it(so_client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, tools=TOOLS,
                                            tool_choice=named)  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert_calls_validate(choice.message.tool_calls, TOOLS)
    chunks = list(so_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, tools=TOOLS,
                                                    tool_choice=named, stream=True))  # fmt: skip
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1, "the arguments stream as they come"
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    validate(json.loads(arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_an_invalid_constraint_is_a_400_before_the_stream(so_server) -> None:
    cases = [
        ("/v1/completions", {"prompt": "x", "guided_regex": "(["}, "guided_regex",
         "guided_regex is invalid (xgrammar)"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "nonsense"}}, "guided_json",
         "guided_json is invalid (xgrammar)"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "nonsense"}}}}, "response_format",
         "response_format.json_schema.schema is invalid (xgrammar)"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, "tool_choice",
         "tool_choice's schema (made of the tools' parameters) is invalid (xgrammar)"),
    ]  # fmt: skip
    for path, body, param, message in cases:
        for stream in (False, True):
            response = post(so_server, path, {**body, "stream": stream, "max_tokens": 4})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["message"].startswith(message), error
    assert so_server.wait_idle().num_running == 0


def test_guided_decoding_backend_must_be_the_servers(so_server) -> None:
    body = {"prompt": "x", "max_tokens": 4, "guided_choice": ["a", "b"]}
    for backend in ("xgrammar", "auto"):
        assert post(so_server, "/v1/completions", {**body, "guided_decoding_backend": backend}).status_code == 200
    refused = post(so_server, "/v1/completions", {**body, "guided_decoding_backend": "guidance"})
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "guided_decoding_backend 'guidance': this server's structured-output backend is 'xgrammar', and a "
        "request cannot choose another; start the server with --structured-outputs-backend guidance, or leave the "
        "field out",
        "type": "BadRequestError",
        "param": "guided_decoding_backend",
        "code": 400,
    }


def test_constraints_hold_with_the_engine_in_a_process_of_its_own(tiny_path) -> None:
    """The default serving layout (``--engine-process``): constraints travel to the engine process with their
    requests, compile there, and hold in both response paths; a broken one is still a 400 from the front-end."""
    pytest.importorskip("nanovllm_structured_xgrammar")
    openai = pytest.importorskip("openai")
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, api_key=API_KEY), engine_process=True,
                          plugins={"structured_output_backend": "xgrammar"})  # fmt: skip
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, seed=4,
                                             response_format=response_format)  # fmt: skip
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        validate(json.loads(out.choices[0].message.content), SCHEMA)
        text, finish = stream_text(client.completions.create(
            model=MODEL, prompt="Pick:", max_tokens=50, stream=True, seed=5,
            extra_body={"structured_outputs": {"choice": ["left", "right"]}}))  # fmt: skip
        assert (text, finish) in (("left", "stop"), ("right", "stop"))
        with pytest.raises(openai.BadRequestError, match="guided_regex"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(("})
    finally:
        thread.stop()
