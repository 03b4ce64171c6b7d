"""The OpenAI API's request and response bodies (completions, chat completions, models, errors), and vLLM's
``/tokenize`` and ``/detokenize``.

Requests accept unknown fields (logged and ignored, as vLLM does), and vLLM's extra fields: ``top_k``,
``min_p``, ``ignore_eos``, ``repetition_penalty``, ``priority``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:N"``, which unlike text
is unique per token), and ``prompt_logprobs`` for completions.

Structured outputs (vLLM's semantics), one constraint a request: ``structured_outputs`` (vLLM's
``StructuredOutputsParams`` fields), the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, OpenAI's ``response_format`` (``json_object``, ``json_schema``) and, for chat, ``tool_choice``
``"required"`` or a named function (the reply constrained to tool calls). :class:`StructuredOutputsError` names the
field a bad or conflicting value came in.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer, model_validator

from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputsParams

# vLLM's older request fields of structured outputs, and the StructuredOutputsParams field each one sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# what vLLM's `structured_outputs` object may hold here: one constraint and its options (disable_fallback is
# accepted and changes nothing: no backend falls back to another here)
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                           "disable_fallback")  # fmt: skip
# the request fields that go to SamplingParams as they are
SAME_AS_SAMPLING_PARAMS = (
    "n", "stop_token_ids", "ignore_eos", "seed", "skip_special_tokens", "presence_penalty", "frequency_penalty",
    "include_stop_str_in_output", "priority", "truncate_prompt_tokens", "min_tokens", "allowed_token_ids", "bad_words",
)  # fmt: skip


class OpenAIModel(BaseModel):
    # JSON's Infinity and NaN (which Python's json module writes) are refused: no field takes them
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class StructuredOutputsError(InvalidRequestError):
    """A structured-output field of a request is invalid, or conflicts with another: a 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaResponseFormat(OpenAIModel):
    """``response_format.json_schema``: the schema the output follows (``strict`` is accepted; the constraint is
    always enforced)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON following ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


def structured_outputs_params(param: str, field: str | None = None, **fields: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)`` from request field ``param``; its errors are StructuredOutputsErrors
    that name the field as the client wrote it: ``field`` (the request's field holding the constraint, such as
    ``guided_regex``), or with None ``param.kind`` (``param`` is an object of StructuredOutputsParams' fields)."""
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as exc:
        message = str(exc)
        for kind in fields:
            message = message.replace(f"StructuredOutputsParams.{kind}", field or f"{param}.{kind}")
        raise StructuredOutputsError(message.replace("StructuredOutputsParams", field or param), param) from None


def prompt_batch(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completion's ``prompt`` or an embedding's ``input`` (validated as one of the union's members) as a list
    of prompts, each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):  # a list of ints: one prompt of token ids
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


class SamplingRequest(OpenAIModel):
    """The fields both endpoints share: the model, streaming, and how to sample."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias, clamped to [-100, 100]
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    # structured outputs: one constraint a request (structured_outputs_params)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams, as a JSON object
    guided_json: StrictStr | dict[str, Any] | None = None  # vLLM's older fields
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None  # only the server's own backend (or "auto"): see api_server

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.logit_bias and not all(key.isdecimal() for key in self.logit_bias):
            bad = [key for key in self.logit_bias if not key.isdecimal()][:3]
            raise ValueError(f"logit_bias keys are token ids written as decimal strings (such as \"1234\"), not {bad}")
        return self

    def constraint_fields(self) -> list[tuple[str, str]]:
        """The fields that constrain this request's output, each as (how it reads in errors, the field)."""
        found = [(name, name) for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            found.append((f"response_format {self.response_format.type}", "response_format"))
        return found

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint of this request's output (vLLM's mapping of its fields), or None; a StructuredOutputsError
        for an invalid value, or for more than one constraint."""
        found = self.constraint_fields()
        if len(found) > 1:
            raise StructuredOutputsError(
                f"a request takes one structured-output constraint, but this one has {len(found)}: "
                f"{', '.join(label for label, _ in found)}; send only one",
                found[1][1],
            )
        return self.constraint(found[0][1]) if found else None

    def constraint(self, param: str) -> StructuredOutputsParams:
        """The constraint that field ``param`` (one :meth:`constraint_fields` found) sets."""
        if param in GUIDED_FIELDS:
            return structured_outputs_params(param, param, **{GUIDED_FIELDS[param]: getattr(self, param)})
        if param == "structured_outputs":
            fields = self.structured_outputs or {}
            unknown = [key for key in fields if key not in STRUCTURED_OUTPUTS_KEYS]
            if unknown:
                raise StructuredOutputsError(
                    f"structured_outputs.{unknown[0]} is not supported; structured_outputs takes "
                    f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}",
                    param,
                )
            for option in ("disable_any_whitespace", "disable_fallback"):
                if not isinstance(fields.get(option, False), bool):
                    raise StructuredOutputsError(f"structured_outputs.{option} is true or false", param)
            fields = {key: value for key, value in fields.items() if key != "disable_fallback"}
            return structured_outputs_params(param, **fields)
        assert self.response_format is not None and param == "response_format"
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        json_schema = self.response_format.json_schema
        if json_schema is None or json_schema.json_schema is None:
            raise StructuredOutputsError(
                'response_format json_schema needs the schema: {"type": "json_schema", "json_schema": {"name": ..., '
                '"schema": {...}}}',
                param,
            )
        return structured_outputs_params(param, "response_format.json_schema.schema", json=json_schema.json_schema)

    def constraint_name(self, param: str, kind: str) -> str:
        """How errors name the ``kind`` constraint (StructuredOutputsParams' field) that field ``param`` set."""
        if param == "structured_outputs":
            return f"structured_outputs.{kind}"
        if param == "response_format" and kind == "json":
            return "response_format.json_schema.schema"
        return param

    def engine_error(self, exc: InvalidRequestError) -> InvalidRequestError:
        """The engine's error ``exc`` as the client should read it: when it is about this request's constraint
        (the engine says ``structured_outputs`` and ``structured_outputs.<kind>``), naming the field it came in."""
        message = str(exc)
        found = self.constraint_fields()
        if len(found) != 1 or not message.startswith("structured_outputs"):
            return exc
        param = found[0][1]
        kind = self.constraint(param).kind
        if message.startswith(f"structured_outputs.{kind} "):
            return StructuredOutputsError(self.constraint_name(param, kind) + message.removeprefix(
                f"structured_outputs.{kind}"), param)  # fmt: skip
        return StructuredOutputsError(param + message.removeprefix("structured_outputs"), param)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's parameters for this request; ``defaults`` (the checkpoint's generation_config.json, vLLM's
        ``--generation-config``) stand in for the sampling fields the request left out."""
        defaults = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        return SamplingParams(
            **{name: getattr(self, name) for name in SAME_AS_SAMPLING_PARAMS},
            temperature=defaults.get("temperature", self.temperature),
            top_p=defaults.get("top_p", self.top_p),
            top_k=defaults.get("top_k", self.top_k if self.top_k is not None else -1),
            min_p=defaults.get("min_p", self.min_p),
            repetition_penalty=defaults.get("repetition_penalty", self.repetition_penalty),
            max_tokens=max_tokens,
            stop=self.stop or None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=self.structured_outputs_params(),
            output_kind="delta",
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or lists of token ids."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt (and its logprobs) alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        prompt = self.prompt  # token ids (ints) need no per-item look: a long id list would cost every request
        if isinstance(prompt, list) and (not prompt or (not isinstance(prompt[0], int) and any(not p for p in prompt))):
            raise ValueError("prompt must not be empty (nor hold an empty prompt)")
        if self.prompt == "":
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: only best_of equal to n ({self.n})")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0`` (vLLM's echo without generation: scoring a prompt)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to ask the engine for: ``prompt_logprobs``, or with ``echo`` the ``logprobs`` that
        the echoed prompt tokens carry, whichever is larger."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or [])


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: the reply is one call to that function."""

    type: Literal["function"]
    function: ToolChoiceFunction


def function_parameters(function: FunctionDefinition) -> dict[str, Any]:
    """A function's parameters schema (a function without one takes an empty object, as vLLM's)."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def required_tool_calls_schema(tools: list[ChatTool], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The JSON schema of a reply to ``tool_choice: "required"`` (vLLM's): an array of one or more calls, each
    ``{"name": <one tool's name>, "parameters": <its parameters>}``; every tool's ``$defs`` are moved to the top,
    where the ``$ref``s into them resolve. ``parallel_tool_calls=false``: one call only (OpenAI's field)."""
    calls = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = dict(function_parameters(tool.function))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise StructuredOutputsError(
                    f'tools: the "$defs" entry {name!r} differs between tools; tool_choice "required" needs one '
                    "schema per name",
                    "tools",
                )
        calls.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ChatPrompt(OpenAIModel):
    """The fields that make a chat prompt, shared by chat completions and ``/tokenize``: the messages, the tools
    the chat template describes to the model, and how it renders them (vLLM's ``continue_final_message``: the
    prompt ends inside the last message, the assistant's, so that the reply continues it; it excludes
    ``add_generation_prompt``, a new turn)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> ChatPrompt:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message=true needs add_generation_prompt=false (a new turn would follow)"
                )
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message=true needs the last message to be the assistant's")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the dicts a chat template reads (``apply_chat_template(tools=...)``), or None."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the plain dicts a chat template reads (content parts joined into one string)."""
        conversation = []
        for message in self.messages:
            entry = {**(message.model_extra or {}), "role": message.role, "content": message.text()}
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        return conversation


class ChatCompletionRequest(SamplingRequest, ChatPrompt):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over the older ``max_tokens``."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # "auto" (the default with tools) needs the server's --enable-auto-tool-choice; "required" and a named
    # function constrain the reply to tool calls (structured outputs), with no flag needed
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # "auto": accepted (a parser returns every call the model wrote); "required": false allows one call only
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            shown = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
            raise ValueError(f"tool_choice {shown!r} needs tools")
        return self

    @property
    def named_tool(self) -> str | None:
        """The function a named ``tool_choice`` calls, or None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_calls(self) -> bool:
        """Whether the reply is constrained to tool calls: ``tool_choice`` "required" or a named function."""
        return self.tool_choice == "required" or self.named_tool is not None

    def constraint_fields(self) -> list[tuple[str, str]]:
        found = super().constraint_fields()
        if self.forces_tool_calls:
            found.append(("tool_choice required" if self.tool_choice == "required" else "tool_choice function",
                          "tool_choice"))  # fmt: skip
        return found

    def constraint_name(self, param: str, kind: str) -> str:
        if param == "tool_choice":
            return "tool_choice's schema (made of the tools' parameters)"
        return super().constraint_name(param, kind)

    def constraint(self, param: str) -> StructuredOutputsParams:
        if param != "tool_choice":
            return super().constraint(param)
        assert self.tools
        if self.named_tool is None:
            return StructuredOutputsParams(json=required_tool_calls_schema(self.tools, self.parallel_tool_calls))
        tool = next((t for t in self.tools if t.function.name == self.named_tool), None)
        if tool is None:
            names = ", ".join(repr(t.function.name) for t in self.tools)
            raise StructuredOutputsError(
                f"tool_choice names the function {self.named_tool!r}, which is not in tools (they are {names})",
                "tool_choice",
            )
        return StructuredOutputsParams(json=function_parameters(tool.function))

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the reply is searched for tool calls: tools given and tool_choice "auto" (their default)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's fields): its token ids as a completion request would send."""

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """``POST /tokenize`` with ``messages``: the prompt the chat template makes of them, as chat completions send
    it (``add_special_tokens`` false by default, as in vLLM: the template writes its own)."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt]


# --- responses -----------------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extra: for each prompt position (None for the first), token id -> its logprob, rank and text
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class ChoicesResponse(BaseModel):
    """What completions and chat completions (whole or a stream's chunk) answer: each subclass sets ``object``
    and the type of ``choices`` (a field a subclass declares again keeps its place in the JSON)."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class CompletionResponse(ChoicesResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class WithoutNone(BaseModel):
    """A tool call's delta: its None fields are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(WithoutNone):
    name: str | None = None  # the call's first delta only
    arguments: str | None = None  # JSON text; a call's deltas' arguments joined are the whole


class DeltaToolCall(WithoutNone):
    index: int  # the call's position in the message: clients assemble a call's deltas by it
    id: str | None = None  # id, type and the function's name: the call's first delta only (left out after)
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    reasoning_content: str | None = None  # with a --reasoning-parser: the thinking, apart from the answer
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # vLLM's: [] when the model called none


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ChoicesResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: str | None = None  # the first chunk of a choice only; left out of the others, as OpenAI does
    content: str | None = None
    # both left out of the JSON when empty, as vLLM does
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty_extras(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.role is None:
            data.pop("role", None)
        if not self.tool_calls:
            data.pop("tool_calls", None)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
        return data


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ChoicesResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "nanovllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings`` (OpenAI's): each input's L2-normalised last-token hidden state (``LLM.embed``)."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_input(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
