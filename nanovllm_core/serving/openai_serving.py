"""Engine outputs to OpenAI responses: whole (non-streaming) bodies and SSE events, with logprobs and usage.

A request of ``k`` prompts with ``n`` samples each is ``k`` engine requests; choice ``i * n + j`` is sample
``j`` of prompt ``i`` (the OpenAI numbering). Every stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.parsing import ParsedToolCall, ReasoningParser, ToolParser
from nanovllm_core.serving.async_llm import AsyncLLM, RequestStream
from nanovllm_core.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    now,
)

DONE = "data: [DONE]\n\n"
dumps = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps with options builds one per call


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


@dataclass
class Job:
    """One API request as the engine sees it: its streams (one per prompt) and how to render the answer."""

    engine: AsyncLLM
    response_id: str
    model: str
    streams: list[RequestStream]
    n: int
    logprobs: int | None  # top logprobs per token; None: no logprobs
    include_usage: bool = False
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    echo_only: bool = False  # echo with max_tokens=0: the prompt alone (the engine's one token is left out)
    show_prompt_logprobs: bool = False  # the prompt_logprobs field (vLLM's) was asked for
    tool_parser: ToolParser | None = None  # chat with tools and tool_choice "auto": the reply is parsed
    forced_tool_calls: ForcedToolCalls | None = None  # chat with tool_choice "required" or a named function
    reasoning_parser: ReasoningParser | None = None  # chat on a server with --reasoning-parser
    prompt_logprobs_sent: set[int] = field(default_factory=set)
    completion_tokens: list[int] = field(default_factory=list)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # prompt index -> the engine's prompt logprobs
    created: int = field(default_factory=now)  # one time for every chunk of the response, as OpenAI and vLLM

    def __post_init__(self) -> None:
        self.completion_tokens = [0] * (len(self.streams) * self.n)

        def head(kind: str) -> str:
            return (
                f'{{"id":{dumps(self.response_id)},"object":"{kind}","created":{self.created},'
                f'"model":{dumps(self.model)},"choices":[{{"index":'
            )

        self._completion_head = head("text_completion")
        self._chat_head = head("chat.completion.chunk")

    def completion_chunk(self, index: int, c: CompletionOutput) -> str:
        """The SSE event of a completion delta without logprobs: the JSON ``CompletionResponse.model_dump_json``
        gives (tested), built directly, at a fifth of the cost, since the server renders one per request and step."""
        return (
            f'data: {self._completion_head}{index},"text":{dumps(c.text)},"logprobs":null,"finish_reason":'
            f'{dumps(c.finish_reason)},"stop_reason":{dumps(c.stop_reason)},"prompt_logprobs":null}}],"usage":'
            f"{self._usage_json(index)}}}\n\n"
        )

    def chat_chunk(self, index: int, c: CompletionOutput) -> str:
        """The SSE event of a chat delta without logprobs (as ``ChatCompletionChunk.model_dump_json``, tested)."""
        return (
            f'data: {self._chat_head}{index},"delta":{{"content":{dumps(c.text)}}},"logprobs":null,'
            f'"finish_reason":{dumps(c.finish_reason)},"stop_reason":{dumps(c.stop_reason)}}}],"usage":'
            f"{self._usage_json(index)}}}\n\n"
        )

    def chunk_usage(self, index: int | None) -> UsageInfo | None:
        """With ``continuous_usage``: the usage so far of choice ``index`` (its prompt's tokens and its own
        completion tokens), or of the whole request for ``None``; else None (a chunk's ``usage`` is null)."""
        if not self.continuous_usage:
            return None
        if index is None:  # the request's first chunk: every prompt, nothing generated yet
            return self.usage()
        prompt = self.streams[index // self.n].num_prompt_tokens
        completion = self.completion_tokens[index]
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _usage_json(self, index: int) -> str:
        usage = self.chunk_usage(index)
        return "null" if usage is None else usage.model_dump_json()

    def take_prompt_logprobs(self, index: int) -> list[dict[int, PromptLogprob] | None] | None:
        """The prompt logprobs of choice ``index``'s prompt, once per choice (its first chunk carries them)."""
        if index in self.prompt_logprobs_sent or not self.show_prompt_logprobs:
            return None
        self.prompt_logprobs_sent.add(index)
        raw = self.prompt_logprobs.get(index // self.n)
        if raw is None:
            return None
        return [
            None if position is None else {t: PromptLogprob(**vars(lp)) for t, lp in position.items()}
            for position in raw
        ]

    def event(self, response: type[CompletionResponse | ChatCompletionChunk], choices: list, usage: Any) -> str:
        """An SSE event of this response: its id, time and model around ``choices`` and ``usage``."""
        body = response(id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse(body.model_dump_json())

    def usage(self) -> UsageInfo:
        prompt = sum(s.num_prompt_tokens for s in self.streams)
        completion = sum(self.completion_tokens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[AsyncIterator[tuple[int, CompletionOutput]]]:
        """``async with job.reading() as outputs``: (choice index, delta completion) as they come, from all
        prompts. Leaving early (a disconnect, a cancellation, an error) aborts the unfinished requests."""
        outputs = self._outputs()
        try:
            yield outputs
        finally:
            await outputs.aclose()
            abort_unfinished(self.engine, self.streams)

    async def _outputs(self) -> AsyncIterator[tuple[int, CompletionOutput]]:
        async with contextlib.aclosing(merge_streams(self.streams)) as merged:
            async for i, out in merged:
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs.setdefault(i, out.prompt_logprobs)
                for c in out.outputs:
                    index = i * self.n + c.index
                    if self.echo_only:  # the token the engine had to compute is not part of the answer
                        c = dataclasses.replace(
                            c,
                            text="",
                            token_ids=[],
                            logprobs=None if c.logprobs is None else [],
                            finish_reason="length" if c.finish_reason else None,  # max_tokens=0 reached
                            stop_reason=None,
                        )
                    self.completion_tokens[index] += len(c.token_ids)
                    yield index, c

    def prompt_text(self, index: int) -> str:
        """Choice ``index``'s prompt as text: as sent, or decoded from the token ids that were sent."""
        stream = self.streams[index // self.n]
        if stream.prompt is not None:
            return stream.prompt
        return self.engine.tokenizer.decode(stream.prompt_token_ids)

    def token_text(self, token_id: int, decoded: str | None) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.engine.tokenizer.decode([token_id])

    def top(self, position: dict[int, Any]) -> list[tuple[int, Any]]:
        return sorted(position.items(), key=lambda item: -item[1].logprob)[: self.logprobs]


@dataclass(frozen=True)
class ForcedToolCalls:
    """A chat reply that structured outputs constrained to tool calls (vLLM's reading of it): with ``tool_choice``
    "required" (``function`` None) a JSON array of ``{"name", "parameters"}`` objects, one a call; with a named
    function (``function``) that function's arguments."""

    function: str | None = None

    def parse(self, text: str) -> list[ParsedToolCall] | None:
        """The calls ``text`` (the whole reply) makes; None when it does not read as them (cut short by max_tokens
        or a stop string). A named function's call carries the text as it is (cut short too: finish_reason says)."""
        if self.function is not None:
            return [ParsedToolCall(self.function, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        if not all(isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
                   for item in items):  # fmt: skip
            return None
        return [ParsedToolCall(item["name"], dumps(item["parameters"])) for item in items]

    def finish_reason(self, calls: list[ParsedToolCall] | None, finish_reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" for "required" calls that ended as they should (vLLM's); a
        named function's, as OpenAI's, keeps the engine's ("stop")."""
        if self.function is None and calls and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def abort_unfinished(engine: AsyncLLM, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.done:
            engine.abort_nowait(stream.request_id)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


# --- completions ---------------------------------------------------------------------------------------


class CompletionLogprobsBuilder:
    """The legacy ``logprobs`` object of one choice: tokens, their logprobs, the top ones, text offsets."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.offset = 0

    def build(self, c: CompletionOutput, into: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        """Output ``c``'s tokens, appended to ``into`` when given (a whole response's logprobs so far)."""
        if self.job.logprobs is None or c.logprobs is None:
            return into
        return self._tokens(c.token_ids, c.logprobs, into)

    def build_prompt(self, index: int) -> CompletionLogprobs | None:
        """With ``echo``: the prompt tokens of choice ``index``'s prompt; the first has no logprob (null)."""
        if self.job.logprobs is None:
            return None
        stream = self.job.streams[index // self.job.n]
        positions = self.job.prompt_logprobs.get(index // self.job.n) or [None] * stream.num_prompt_tokens
        return self._tokens(stream.prompt_token_ids, positions)

    def _tokens(
        self, token_ids: list[int], positions: list[dict[int, Any] | None], into: CompletionLogprobs | None = None
    ) -> CompletionLogprobs:
        result = into if into is not None else CompletionLogprobs()
        for token_id, position in zip(token_ids, positions):
            own = position.get(token_id) if position is not None else None
            text = self.job.token_text(token_id, own.decoded_token if own else None)
            result.tokens.append(text)
            result.text_offset.append(self.offset)
            self.offset += len(text)
            if position is None:  # the prompt's first token
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(own.logprob if own else None)
            # keyed by text, as OpenAI's legacy format: of tokens with the same text the likeliest is kept
            top: dict[str, float] = {}
            for t, lp in self.job.top(position):
                top.setdefault(self.job.token_text(t, lp.decoded_token), lp.logprob)
            top.setdefault(text, own.logprob if own else float("-inf"))  # the chosen token is always listed
            result.top_logprobs.append(top)
        return result


async def completion_response(job: Job) -> CompletionResponse:
    texts: dict[int, list[str]] = {}
    choices: dict[int, CompletionChoice] = {}
    builders: dict[int, CompletionLogprobsBuilder] = {}
    async with job.reading() as outputs:
        async for index, c in outputs:
            if index not in choices:
                choices[index] = CompletionChoice(index=index, text="", prompt_logprobs=job.take_prompt_logprobs(index))
                builders[index] = CompletionLogprobsBuilder(job)
                if job.echo:
                    texts[index] = [job.prompt_text(index)]
                    choices[index].logprobs = builders[index].build_prompt(index)
            choice = choices[index]
            texts.setdefault(index, []).append(c.text)
            choice.logprobs = builders[index].build(c, into=choice.logprobs)
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    for index, choice in choices.items():
        choice.text = "".join(texts[index])
    ordered = [choices[i] for i in sorted(choices)]
    return CompletionResponse(id=job.response_id, model=job.model, choices=ordered, usage=job.usage())


async def completion_events(job: Job) -> AsyncIterator[str]:
    builders: dict[int, CompletionLogprobsBuilder] = {}
    echoed: set[int] = set()
    try:
        async with job.reading() as outputs:
            async for index, c in outputs:
                if job.echo and index not in echoed:  # the prompt first, in an event of its own
                    echoed.add(index)
                    builder = builders.setdefault(index, CompletionLogprobsBuilder(job))
                    choice = CompletionChoice(
                        index=index,
                        text=job.prompt_text(index),
                        logprobs=builder.build_prompt(index),
                        prompt_logprobs=job.take_prompt_logprobs(index),
                    )
                    yield job.event(CompletionResponse, [choice], job.chunk_usage(index))
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                prompt_logprobs = job.take_prompt_logprobs(index)
                if job.logprobs is None and prompt_logprobs is None:
                    yield job.completion_chunk(index, c)
                    continue
                builder = builders.setdefault(index, CompletionLogprobsBuilder(job))
                choice = CompletionChoice(
                    index=index,
                    text=c.text,
                    logprobs=builder.build(c),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
                yield job.event(CompletionResponse, [choice], job.chunk_usage(index))
        if job.include_usage:
            yield job.event(CompletionResponse, [], job.usage())
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse(stream_error(exc))
    yield DONE


# --- chat ----------------------------------------------------------------------------------------------


def chat_logprobs(job: Job, c: CompletionOutput) -> ChoiceLogprobs | None:
    if job.logprobs is None or c.logprobs is None:
        return None
    content = []
    for token_id, position in zip(c.token_ids, c.logprobs):
        own = position.get(token_id)
        text = job.token_text(token_id, own.decoded_token if own else None)
        top = [
            TopLogprob(token=(t := job.token_text(tid, lp.decoded_token)), logprob=lp.logprob, bytes=list(t.encode()))
            for tid, lp in job.top(position)
        ]
        logprob = own.logprob if own else float("-inf")
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


async def chat_response(job: Job) -> ChatCompletionResponse:
    choices: dict[int, ChatChoice] = {}
    texts: dict[int, list[str]] = {}
    async with job.reading() as outputs:
        async for index, c in outputs:
            choice = choices.setdefault(index, ChatChoice(index=index, message=AssistantMessage(content="")))
            texts.setdefault(index, []).append(c.text)
            delta = chat_logprobs(job, c)
            if delta is not None and choice.logprobs is not None:
                choice.logprobs.content.extend(delta.content or [])  # type: ignore[union-attr]
            elif delta is not None:
                choice.logprobs = delta
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    for index, choice in choices.items():
        text = "".join(texts[index])
        if job.reasoning_parser is not None:
            choice.message.reasoning_content, text = job.reasoning_parser.parse(text)
        if job.forced_tool_calls is not None:
            calls = job.forced_tool_calls.parse(text)
            choice.message.content = None if calls else text
            choice.message.tool_calls = [tool_call(call) for call in calls or []]
            choice.finish_reason = job.forced_tool_calls.finish_reason(calls, choice.finish_reason)
            continue
        if job.tool_parser is None:
            choice.message.content = text if text or choice.message.reasoning_content is None else None
            continue
        parsed = job.tool_parser.parse(text)
        choice.message.content = parsed.content
        choice.message.tool_calls = [tool_call(call) for call in parsed.tool_calls]
        if parsed.tool_calls:
            choice.finish_reason = "tool_calls"
    ordered = [choices[i] for i in sorted(choices)]
    return ChatCompletionResponse(id=job.response_id, model=job.model, choices=ordered, usage=job.usage())


def tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


async def chat_events(job: Job) -> AsyncIterator[str]:
    try:
        num_choices = len(job.streams) * job.n  # OpenAI's first chunk of each choice carries the role
        roles = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(num_choices)]  # fmt: skip
        yield job.event(ChatCompletionChunk, roles, job.chunk_usage(None))
        replies = None
        if job.tool_parser is not None or job.reasoning_parser is not None or job.forced_tool_calls is not None:
            replies = [ReplyStream(job) for _ in range(num_choices)]
        async with job.reading() as outputs:
            async for index, c in outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                if job.logprobs is None and replies is None:
                    yield job.chat_chunk(index, c)
                    continue
                delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                if replies is not None:
                    delta, finish_reason = replies[index].delta(c)
                choice = ChatStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=chat_logprobs(job, c),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
                yield job.event(ChatCompletionChunk, [choice], job.chunk_usage(index))
        if job.include_usage:
            yield job.event(ChatCompletionChunk, [], job.usage())
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse(stream_error(exc))
    yield DONE


class ReplyStream:
    """One choice of a chat stream whose reply is parsed (the job's parsers): reasoning apart (``reasoning_parser``),
    then the answer searched for tool calls (``tool_parser``), or read as the tool calls it was constrained to
    (``forced_tool_calls``), each a delta at a time."""

    def __init__(self, job: Job) -> None:
        self.tools = job.tool_parser.new_stream() if job.tool_parser is not None else None
        self.reasoning = job.reasoning_parser.new_stream() if job.reasoning_parser is not None else None
        self.forced = job.forced_tool_calls
        self.answer: list[str] = []  # "required": the reply so far, read as calls once whole
        self.named_call_id: str | None = None  # a named function's call, once its first delta is out

    def delta(self, c: CompletionOutput) -> tuple[DeltaMessage, str | None]:
        """The delta of output ``c``: its reasoning, the content let out and each tool call whole as it closes;
        the last delta's finish_reason is "tool_calls" if the reply made any."""
        reasoning: str | None = None
        content: str | None = c.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(c.text)
            if c.finish_reason is not None:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.forced is not None:
            return self.forced_delta(content or "", reasoning, c.finish_reason)
        deltas: list[DeltaToolCall] = []
        finish_reason = c.finish_reason
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            first = self.tools.num_calls - len(calls)
            deltas = [whole_call_delta(first + i, call) for i, call in enumerate(calls)]
            if finish_reason is not None:
                rest, _ = self.tools.finish()
                content += rest
                if self.tools.num_calls:
                    finish_reason = "tool_calls"
        if not content and (reasoning or deltas):
            content = None  # a delta of thinking or of calls only
        return DeltaMessage(content=content, reasoning_content=reasoning or None, tool_calls=deltas), finish_reason

    def forced_delta(
        self, text: str, reasoning: str | None, finish_reason: str | None
    ) -> tuple[DeltaMessage, str | None]:
        """A delta of a reply constrained to tool calls (vLLM's streaming of it): a named function's arguments as
        they come, as deltas of its one call; "required" calls each whole at the end (or, should the reply not
        read as calls, its text as content)."""
        assert self.forced is not None
        deltas: list[DeltaToolCall] = []
        content: str | None = None
        if self.forced.function is not None:
            if self.named_call_id is None:
                if text or finish_reason is not None:  # the call's first delta: its id, type and name
                    self.named_call_id = ParsedToolCall(self.forced.function, "").id
                    function = DeltaFunctionCall(name=self.forced.function, arguments=text)
                    deltas.append(DeltaToolCall(index=0, id=self.named_call_id, type="function", function=function))
            elif text:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text)))
        else:
            self.answer.append(text)
            if finish_reason is not None:
                whole = "".join(self.answer)
                calls = self.forced.parse(whole)
                deltas = [whole_call_delta(i, call) for i, call in enumerate(calls or [])]
                content = None if calls else whole
                finish_reason = self.forced.finish_reason(calls, finish_reason)
        if content is None and not (reasoning or deltas):
            content = ""  # nothing to say yet: an empty delta, as while a tool parser holds text back
        return DeltaMessage(content=content, reasoning_content=reasoning or None, tool_calls=deltas), finish_reason


def whole_call_delta(index: int, call: ParsedToolCall) -> DeltaToolCall:
    """A tool call in one delta: its id, name and all its arguments."""
    function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
    return DeltaToolCall(index=index, id=call.id, type="function", function=function)


def stream_error(exc: Exception) -> str:
    """An error inside a stream that already began (the engine stopped): OpenAI's error shape as an event."""
    return json.dumps({"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}})
