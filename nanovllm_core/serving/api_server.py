"""The OpenAI-compatible HTTP server (FastAPI): routes, API-key check, OpenAI-shaped errors, disconnects.

``build_app(engine, settings)`` returns the ASGI app; its lifespan starts the engine's step loop and, at
shutdown, aborts what is still in flight and stops the loop (``nanovllm serve`` drains first, on SIGTERM/SIGINT:
:meth:`OpenAIServer.drain`). Before any route, :class:`AdmissionMiddleware` refuses ``/v1/*`` without the API key
(401), every request while the server drains (503) and a body over ``--max-request-body-bytes`` (413). Routes:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``, and vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and ``GET``/``POST /ping``
(``/health``'s answer).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from nanovllm_core import __version__
from nanovllm_core.engine.structured_output import select_structured_output_backend
from nanovllm_core.entrypoints.chat import conversation_chars, render_chat
from nanovllm_core.errors import ConfigError, InvalidRequestError, NanoVLLMError
from nanovllm_core.generation_config import sampling_defaults
from nanovllm_core.plugins import REPLY_PARSER_FLAGS, get_registry
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.serving.admission import (
    check_max_request_body_bytes,
    default_max_request_body_bytes,
    max_prompt_chars,
)
from nanovllm_core.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream
from nanovllm_core.serving.metrics import CONTENT_TYPE, ServerMetrics
from nanovllm_core.serving.openai_serving import (
    ForcedToolCalls,
    Job,
    abort_unfinished,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
)
from nanovllm_core.serving.protocol import (
    ChatCompletionRequest,
    ChatPrompt,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    prompt_batch,
)
from nanovllm_core.serving.timeline import RequestTimelineLog

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# what a field of a union type accepts, for errors that pydantic reports once per member of the union
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "input": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string, a list of strings, or null",
    "content": 'a string, or a list of {"type": "text", "text": ...} parts',
    "tool_choice": '"none", "auto", "required", or {"type": "function", "function": {"name": ...}}',
    "guided_json": "a JSON schema: an object, or its JSON text",
}


@dataclass
class ServerSettings:
    served_model_name: str  # the name responses carry
    other_model_names: tuple[str, ...] = ()  # more names clients may send (vLLM's --served-model-name A B ...)
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests without a first token yet, beyond which 503; None: no limit
    shutdown_timeout: float = 0.0  # seconds the lifespan's shutdown lets in-flight requests finish
    chat_template: str | None = None  # a Jinja chat template instead of the tokenizer's (vLLM's --chat-template)
    allowed_origins: list[str] | None = None  # CORS: browser pages of these origins may call the API; None: none
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: chat replies to requests with tools (tool_choice
    # "auto") are parsed for tool calls
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: chat replies' thinking as reasoning_content
    max_request_body_bytes: int | None = None  # larger bodies get 413; None: sized from max_model_len
    request_timeline: str | None = None  # --request-timeline: a JSON line of each finished request's stamps

    def __post_init__(self) -> None:
        check_reply_parsers(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)
        check_max_request_body_bytes(self.max_request_body_bytes)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.other_model_names)


def reply_parser(kind: str, name: str) -> type:
    """The class registered as tool parser or reasoning parser ``name``; a ConfigError names the installed ones."""
    try:
        return get_registry().get(kind, name).obj
    except NanoVLLMError as exc:
        raise ConfigError(f"{REPLY_PARSER_FLAGS[kind]} {name!r}: {exc}") from None


def check_reply_parsers(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None
) -> None:
    """A ConfigError unless the parsers are installed and auto tool choice has one (vLLM's rule for the flags)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        installed = ", ".join(get_registry().names("tool_parser")) or "none"
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser (installed: {installed})")
    for kind, name in (("tool_parser", tool_call_parser), ("reasoning_parser", reasoning_parser)):
        if name is not None:
            reply_parser(kind, name)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), param=param, code=status)
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


DRAINING = "the server is shutting down and takes no new requests"
RETRY = {"Retry-After": "1"}


async def read_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model`` by pydantic's own parser, on the raw bytes, instead of FastAPI's body
    parameter (``json.loads``, validation, dependency bookkeeping), which costs a burst of requests time to first
    token. Errors are FastAPI's ``RequestValidationError`` (locations under ``body``), so they read the same."""
    raw = await request.body()
    if "json" not in request.headers.get("content-type", ""):
        raise RequestValidationError(
            [{"type": "model_attributes_type", "loc": ("body",), "msg": "not a JSON object", "input": raw[:80]}]
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def tokenize_body_model(raw: bytes) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """Which ``/tokenize`` body this is: chat when it has ``messages``, else a prompt (whose errors a body that is
    neither then gets)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return TokenizeCompletionRequest
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message (the field, what was wrong, what is allowed) for pydantic's list of errors."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        error = str(first.get("ctx", {}).get("error", first["msg"]))
        if "unicode code point" in error or "hex escape" in error:  # bad UTF-8, or a lone surrogate's \u escape
            error += " (JSON text must be UTF-8, and a \\u escape of a surrogate must be one of a pair)"
        return f"the request body is not valid JSON: {error}", None
    if not loc and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return "the request body must be a JSON object (sent with Content-Type: application/json)", None
    if not loc:  # a check across fields (model_validator)
        return str(first["msg"]).removeprefix("Value error, "), None
    param = loc[0]
    union_field = next((p for p in loc if p in UNION_FIELDS), None)
    if union_field is not None and first.get("type") != "missing":
        return f"{'.'.join(loc[: loc.index(union_field) + 1])}: must be {UNION_FIELDS[union_field]}", param
    got = f" (got {first['input']!r})" if "input" in first and first.get("type") != "missing" else ""
    return f"{'.'.join(loc)}: {first['msg']}{got}", param


class RequestBodyTooLarge(Exception):
    """Raised into the app from ``receive`` once a body without Content-Length has passed the limit."""


class AdmissionMiddleware:
    """Before any route (pure ASGI: streaming and disconnects pass through untouched): with ``api_key``, 401 for
    ``/v1/*`` without ``Authorization: Bearer <key>``; while the server drains, 503 with Retry-After for every
    request but ``/metrics``; a request body over the limit is a 413, from its Content-Length before any of it is
    read, or (a chunked body) as soon as the bytes the app has read pass the limit."""

    def __init__(self, app: Any, server: OpenAIServer, max_body_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.server = server
        self.max_body_bytes = max_body_bytes
        self.expected_key = f"Bearer {api_key}".encode() if api_key else None

    def too_large(self, size: str) -> Response:
        return error_response(
            413,
            f"the request body ({size}) is larger than this server takes (--max-request-body-bytes "
            f"{self.max_body_bytes}): send a shorter prompt, or start the server with a larger limit",
        )

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["received"] = time.monotonic()  # the start of the request's timeline
        headers = dict(scope["headers"])
        if self.expected_key is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_key):
                message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
                await error_response(401, message)(scope, receive, send)
                return
        if self.server.draining and scope["path"] != "/metrics":
            await error_response(503, DRAINING, headers=RETRY)(scope, receive, send)
            return
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" not in headers:  # the HTTP parser holds the body to it
            if length.isdigit() and int(length) > limit:
                await self.too_large(f"Content-Length {int(length)} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestBodyTooLarge
            return message

        async def watching_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except RequestBodyTooLarge:
            if started:
                raise
            await self.too_large(f"over {limit} bytes, chunked")(scope, receive, send)


class EventStreamResponse(StreamingResponse):
    """SSE; the event generator is closed as soon as the response ends or the client goes away, so that the
    requests behind it are aborted at once (not when the generator is garbage-collected)."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Callable) -> None:
        try:
            await super().stream_response(send)
        finally:
            with contextlib.suppress(RuntimeError):  # it may be closing already, from its own exception
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; cancel it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


class OpenAIServer:
    """What the routes do, around one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.sampling_defaults = sampling_defaults(engine.config)  # for the fields a request leaves out
        self.draining = False  # set by drain(): new requests get 503
        self.max_prompt_chars = max_prompt_chars(engine.tokenizer, engine.max_model_len)

    async def drain(self, timeout: float, now: asyncio.Event | None = None) -> None:
        """Shut down gracefully: new requests get 503 (Retry-After) from here on; the requests in flight may
        finish for ``timeout`` seconds (or until ``now`` is set); then the rest are aborted (a stream ends with a
        last chunk of finish_reason "abort" and ``data: [DONE]``, a whole response is a 503 error) and the engine
        stops."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.engine.num_unfinished:
            logger.info(
                "shutting down: %d requests in flight may finish for %g s (--shutdown-timeout); new ones get 503",
                self.engine.num_unfinished, timeout,
            )  # fmt: skip
        while self.engine.num_unfinished and (now is None or not now.is_set()) and loop.time() < deadline:
            await asyncio.sleep(min(deadline - loop.time(), 0.02))
        if self.engine.num_unfinished:
            logger.warning("shutting down: aborting %d requests still in flight", self.engine.num_unfinished)
        await self.engine.shutdown()

    def check_not_aborted_by_shutdown(self, finish_reasons: list[str | None]) -> None:
        """The error a whole (non-streaming) response gets when the shutdown aborted it."""
        if self.draining and "abort" in finish_reasons:
            raise APIError(
                503,
                "the server shut down before this request finished (it was aborted at the end of "
                "--shutdown-timeout): retry it",
                headers=RETRY,
            )

    def check_model(self, model: str | None) -> None:
        names = self.settings.model_names
        if model is not None and model not in names:
            served = " or ".join(map(repr, names))
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model")

    def check_guided_decoding_backend(self, requested: str | None) -> None:
        """vLLM's per-request ``guided_decoding_backend``: as vLLM v1, a server runs one backend, chosen at start
        (``[plugins] structured_output_backend``); a request naming another one is a 400 (``auto`` or the server's
        own are accepted)."""
        if requested is None or requested == "auto":
            return
        backend = self.engine.config.plugins.structured_output_backend
        if backend == "auto":  # the installed one it picks (None: none is installed)
            registry = get_registry()
            chosen = select_structured_output_backend(registry, "auto")
            installed = registry.registrations["structured_output"].items()
            backend = next((name for name, registration in installed if registration.obj is chosen), None)
        if backend is not None and requested != backend:
            raise APIError(
                400,
                f"guided_decoding_backend {requested!r}: this server's structured-output backend is {backend!r}, and "
                f"a request cannot choose another; start the server with --structured-outputs-backend {requested}, "
                "or leave the field out",
                "guided_decoding_backend",
            )

    def check_capacity(self, num_requests: int) -> None:
        if self.draining:
            raise APIError(503, DRAINING, headers=RETRY)
        if not self.engine.is_running:
            raise APIError(503, "the server is shutting down or its engine has stopped")
        limit = self.settings.max_queued_requests
        if limit is not None and self.engine.num_queued + num_requests > limit:
            raise APIError(
                503,
                f"the request queue is full ({self.engine.num_queued} requests waiting, --max-queued-requests "
                f"{limit}); retry later",
                headers=RETRY,
            )

    def max_tokens(self, num_prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """The request's max_tokens, checked against max_model_len (None: whatever room the prompt leaves)."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"this model's maximum context length (max_model_len) is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens: at most {limit - 1} leave room for one output token",
                prompt_param,
            )
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise APIError(
                400,
                f"this model's maximum context length (max_model_len) is {limit} tokens, but {num_prompt_tokens} "
                f"prompt tokens + max_tokens {requested} = {num_prompt_tokens + requested}: lower max_tokens "
                f"to at most {limit - num_prompt_tokens} or shorten the prompt",
                "max_tokens",
            )
        return requested

    def check_prompt_chars(self, num_chars: int, truncate: int | None, param: str) -> None:
        """A 400 for a text far longer than max_model_len tokens could hold, before any tokenization (not with
        ``truncate_prompt_tokens``: then a text of any length is cut to its last tokens)."""
        limit = self.max_prompt_chars
        if limit is not None and truncate is None and num_chars > limit:
            raise APIError(
                400,
                f"the {param} has {num_chars} characters, more than this model's maximum context length "
                f"(max_model_len {self.engine.max_model_len} tokens) can hold with its tokenizer (at most {limit} "
                "characters): shorten it",
                param,
            )

    async def prompt_ids(self, prompt: str | list[int], truncate: int | None, param: str) -> list[int]:
        """A prompt's token ids: a text checked for length, then tokenized (off the event loop when long); with
        ``truncate``, its last ``truncate`` tokens (cut before the max_model_len check, as vLLM does)."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), truncate, param)
            prompt = await self.engine.encode(prompt)
        return prompt if truncate is None else prompt[-truncate:]

    async def submit(
        self, body: SamplingRequest, prompts: list[list[int]], requested: int | None, prompt_param: str, prefix: str,
        request: Request,
    ) -> Job:
        self.check_model(body.model)
        self.check_guided_decoding_backend(body.guided_decoding_backend)
        if body.model_extra:
            logger.warning("ignoring fields this server does not know: %s", ", ".join(sorted(body.model_extra)))
        completion = body if isinstance(body, CompletionRequest) else None
        echo_only = completion is not None and completion.echo_only
        if echo_only:
            requested = 1  # the engine computes one token; the answer leaves it out
        max_tokens = min(self.max_tokens(len(ids), requested, prompt_param) for ids in prompts)
        logprobs = self.logprobs_of(body)
        prompt_logprobs = completion.engine_prompt_logprobs if completion is not None else None
        params: SamplingParams = body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults)
        self.check_capacity(len(prompts))
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        received = request.scope.get("state", {}).get("received")  # stamped by AdmissionMiddleware
        try:  # before any response starts: the engine's refusal (such as an invalid JSON schema) is a 400
            streams = await self.add_requests(prompts, params, response_id, received)
        except InvalidRequestError as exc:
            raise body.engine_error(exc) from None
        return Job(
            self.engine,
            response_id,
            self.settings.served_model_name,
            streams,
            body.n,
            logprobs,
            body.include_usage,
            body.return_tokens_as_token_ids,
            continuous_usage=body.continuous_usage,
            echo=completion is not None and completion.echo,
            echo_only=echo_only,
            show_prompt_logprobs=completion is not None and completion.prompt_logprobs is not None,
        )

    async def add_requests(
        self, prompts: list[list[int]], params: SamplingParams, response_id: str, received: float | None = None
    ) -> list[RequestStream]:
        """One engine request a prompt, ``{response_id}-{i}``; those added are aborted if one cannot be.
        ``received``: when the HTTP request came (``time.monotonic()``), the start of each one's timeline."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(ids, params, f"{response_id}-{i}", arrival_time=received))
        except BaseException:
            abort_unfinished(self.engine, streams)
            raise
        return streams

    async def respond(
        self, job: Job, body: SamplingRequest, request: Request, events: Callable, whole: Callable
    ) -> Response:
        """The answer to ``job``: an event stream, or the whole response unless the client went away (499)."""
        if body.stream:
            return EventStreamResponse(events(job))
        result = await until_disconnected(request, whole(job))
        if result is None:
            return Response(status_code=499)
        self.check_not_aborted_by_shutdown([c.finish_reason for c in result.choices])
        return JSONResponse(result.model_dump())

    @staticmethod
    def logprobs_of(body: SamplingRequest) -> int | None:
        if isinstance(body, ChatCompletionRequest):
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs  # type: ignore[attr-defined]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400, "max_tokens: 0 needs echo=true (it returns the prompt alone, with logprobs if asked); else at "
                "least 1", "max_tokens"
            )
        prompts = [await self.prompt_ids(p, body.truncate_prompt_tokens, "prompt") for p in prompt_batch(body.prompt)]
        job = await self.submit(body, prompts, body.max_tokens, "prompt", "cmpl", request)
        return await self.respond(job, body, request, completion_events, completion_response)

    async def embeddings(self, body: EmbeddingRequest) -> EmbeddingResponse:
        """OpenAI's ``/v1/embeddings``: one engine request a prompt, each the prompt's last-token embedding."""
        self.check_model(body.model)
        if body.dimensions is not None:
            raise APIError(
                400, "dimensions is not supported: embeddings have the model's hidden size (leave it out)", "dimensions"
            )
        prompts = [await self.prompt_ids(p, body.truncate_prompt_tokens, "input") for p in prompt_batch(body.input)]
        self.check_capacity(len(prompts))
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, embed=True,
                                output_kind="delta")  # fmt: skip
        response_id = f"embd-{uuid.uuid4().hex}"
        streams = await self.add_requests(prompts, params, response_id)
        try:
            finals = []
            for stream in streams:
                async for out in stream:
                    final = out
                finals.append(final)
        except BaseException:
            abort_unfinished(self.engine, streams)
            raise
        self.check_not_aborted_by_shutdown([c.finish_reason for out in finals for c in out.outputs])
        data = []
        for i, out in enumerate(finals):
            vector: list[float] | str = out.embedding or []
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append(EmbeddingData(index=i, embedding=vector))
        tokens = sum(len(ids) for ids in prompts)
        return EmbeddingResponse(id=response_id, model=self.settings.served_model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))  # fmt: skip

    async def chat_prompt(
        self, body: ChatPrompt, add_special_tokens: bool = False, truncate: int | None = None
    ) -> list[int]:
        """The prompt of a chat request: its messages checked for length, then rendered through the chat template
        and tokenized (off the event loop when long); ``truncate``: as :meth:`prompt_ids`'."""
        conversation = body.conversation()
        num_chars = conversation_chars(conversation)
        self.check_prompt_chars(num_chars, truncate, "messages")
        try:
            ids = await self.engine.off_loop(
                num_chars,
                render_chat,
                self.engine.tokenizer,
                conversation,
                body.add_generation_prompt,
                self.settings.chat_template,
                add_special_tokens=add_special_tokens,
                **({"continue_final_message": True} if body.continue_final_message else {}),
                **({"tools": body.template_tools()} if body.tools else {}),
                **(body.chat_template_kwargs or {}),
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from None
        return ids if truncate is None else ids[-truncate:]

    async def tokenize(self, body: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
        """vLLM's ``/tokenize``: the prompt's token ids as the completion or chat endpoint would send them."""
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = await self.chat_prompt(body, body.add_special_tokens)
        else:
            self.check_prompt_chars(len(body.prompt), None, "prompt")
            ids = await self.engine.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's ``/detokenize``: the text of token ids (special tokens included); an id the tokenizer does not
        have is a 400 naming it."""
        self.check_model(body.model)
        tokenizer = self.engine.tokenizer
        vocab = len(tokenizer)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                message = f"tokens[{i}]: {token} is not a token id of this model's tokenizer (0 to {vocab - 1})"
                raise APIError(400, message, "tokens")
        # a token's text is a few characters: as much work as tokenizing that many
        text = await self.engine.off_loop(4 * len(body.tokens), tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        parser = None
        if body.parses_tool_calls:
            if not self.settings.enable_auto_tool_choice:
                raise APIError(
                    400,
                    'tool_choice "auto" (the default with tools) needs the server started with '
                    '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none"',
                    "tool_choice",
                )
            parser = reply_parser("tool_parser", self.settings.tool_call_parser)()  # type: ignore[arg-type]
        ids = await self.chat_prompt(body, truncate=body.truncate_prompt_tokens)
        job = await self.submit(body, [ids], body.requested_max_tokens, "messages", "chatcmpl", request)
        job.tool_parser = parser
        if body.forces_tool_calls:  # tool_choice "required" or a named function: structured outputs made calls
            job.forced_tool_calls = ForcedToolCalls(body.named_tool)
        if self.settings.reasoning_parser is not None:
            job.reasoning_parser = reply_parser("reasoning_parser", self.settings.reasoning_parser)()
        return await self.respond(job, body, request, chat_events, chat_response)


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    log = RequestTimelineLog(settings.request_timeline) if settings.request_timeline else None
    metrics = ServerMetrics(settings.served_model_name, log)
    engine.observer = metrics
    server = OpenAIServer(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        lag = asyncio.ensure_future(metrics.watch_event_loop())
        try:
            yield
        finally:
            lag.cancel()
            await engine.shutdown(settings.shutdown_timeout)
            if log is not None:
                log.close()

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.state.server = server
    max_body = settings.max_request_body_bytes or default_max_request_body_bytes(engine.max_model_len)
    app.add_middleware(AdmissionMiddleware, server=server, max_body_bytes=max_body, api_key=settings.api_key)
    if settings.allowed_origins:  # added last, so it runs first: preflight requests carry no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(EngineDeadError)
    async def plain_error(request: Request, exc: Exception) -> JSONResponse:
        # a StructuredOutputsError names its field (param); the engine's errors name it in the message
        param = getattr(exc, "param", None)
        return error_response(400 if isinstance(exc, InvalidRequestError) else 503, str(exc), param)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(await read_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat(await read_body(request, ChatCompletionRequest), request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        result = await server.embeddings(await read_body(request, EmbeddingRequest))
        return JSONResponse(result.model_dump())

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=name, root=engine.config.model, max_model_len=engine.max_model_len)
                 for name in settings.model_names]  # fmt: skip
        return ModelList(data=cards)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        return await server.tokenize(await read_body(request, tokenize_body_model(await request.body())))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await server.detokenize(await read_body(request, DetokenizeRequest))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    # vLLM's, for SageMaker: what /health says. Two routes, so that OpenAPI gives each method its own operation id.
    app.get("/ping")(health)
    app.post("/ping")(health)

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await engine.stats() if engine.is_running else None
        return Response(metrics.render(stats, engine), media_type=CONTENT_TYPE)

    return app
