"""AsyncLLM: the engine behind an asyncio API (streams of incremental outputs, abort, stats), for servers.

The engine is not thread-safe, so one step loop owns it (an engine client, :mod:`nanovllm_core.engine_client`: a
background thread, a process of its own, or data-parallel replicas). Callers talk to it through commands that the
loop drains between steps; the loop hands its results and each step's outputs back to the event loop in one piece
each (a thread through ``call_soon_threadsafe``; an engine process through its pipe, which the event loop reads
itself), and sleeps while it has nothing to do. Prompts are tokenized on the caller's side with a tokenizer of its
own (so the step loop does no tokenization); a long text is tokenized in a thread of its own
(:meth:`AsyncLLM.off_loop`), so that the event loop keeps serving the other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.core import Prompt, unwrap_prompt
from nanovllm_core.engine.model_core import ModelEngineCore, load_tokenizer
from nanovllm_core.engine_client.base import EngineClient, LoopAccount
from nanovllm_core.engine_client.factory import make_engine_client
from nanovllm_core.engine_client.step_loop import InProcessClient
from nanovllm_core.errors import InvalidRequestError, NanoVLLMError
from nanovllm_core.output_processor import OutputProcessor, RequestState, engine_params
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams, with_priority
from nanovllm_core.serving.timeline import RequestTimeline
from nanovllm_core.tokenization import encode_text

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Tokenizer work on at most this many characters runs on the event loop: it costs less than the hop to the
# tokenizer's thread and back. Longer texts go to that thread (the Rust tokenizer releases the GIL while it works).
INLINE_TOKENIZER_CHARS = 2048


class EngineDeadError(NanoVLLMError):
    """The step loop has stopped (shut down, or an error ended it); no request can be served."""


class OutputObserver(Protocol):
    """Receives request timings as outputs reach the event loop (the server's Prometheus metrics)."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, seconds: float, finish_reason: str | None) -> None: ...

    def timeline(self, timeline: RequestTimeline) -> None:
        """A finished request's stamps, the front-end's and the engine's (``time.monotonic()``, one clock across
        processes)."""

    def delivery_lag(self, seconds: float) -> None:
        """How long a step's outputs took from the engine's hand-over to the front-end acting on them."""


def merge_deltas(items: list[RequestOutput]) -> RequestOutput:
    """Consecutive delta outputs of one request as one (what a consumer that fell behind gets)."""
    if len(items) == 1:
        return items[0]
    parts: dict[int, list[CompletionOutput]] = {}
    for item in items:
        for c in item.outputs:
            parts.setdefault(c.index, []).append(c)
    completions = []
    for index in sorted(parts):
        pieces = parts[index]
        last = pieces[-1]
        if len(pieces) == 1:
            completions.append(last)
            continue
        with_logprobs = [c.logprobs for c in pieces if c.logprobs is not None]
        completions.append(
            dataclasses.replace(
                last,
                text="".join(c.text for c in pieces),
                token_ids=[t for c in pieces for t in c.token_ids],
                logprobs=[p for lp in with_logprobs for p in lp] if with_logprobs else None,
            )
        )
    # the prompt logprobs are sent once, with the first output
    prompt_logprobs = next((i.prompt_logprobs for i in items if i.prompt_logprobs is not None), None)
    return dataclasses.replace(items[-1], outputs=completions, prompt_logprobs=prompt_logprobs)


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the finished output (or raises).

    Outputs that arrive while the consumer is busy wait in a list and are merged into one when it reads: the
    consumer's per-item work (an SSE chunk) is paid per read, not per step. The engine sends token ids only; the
    output processor makes the text as the consumer reads (once per read), or, for a request with stop strings,
    as each output arrives (``eager``: a match must abort its sample, or the request, in the engine at once)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        prompt: str | None = None,
        processor: OutputProcessor | None = None,
        state: RequestState | None = None,
    ) -> None:
        self.request_id = request_id
        self.processor = processor
        self.state = state
        self.eager = state is not None and bool(state.params.stop_strings) and state.params.detokenize
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.prompt = prompt
        self.arrival = time.monotonic()
        # the front-end's stamps of the request's timeline (serving/timeline.py); add_request sets the first three
        self.stamps: dict[str, float | None] = {
            "received": self.arrival, "validated": self.arrival, "handed": self.arrival,
            "first_token_delivered": None, "delivered": None,
        }  # fmt: skip
        self.last_token_time: float | None = None
        self.finished = False  # the last item was handed to the consumer
        self.done = False  # the last item arrived (the consumer may not have read it yet)
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._error is not None:
            return  # already failed
        if isinstance(item, BaseException):
            self._error = item
            self.done = True
        else:
            self._pending.append(item)
            self.done = item.finished
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The user's output for the engine's (None: nothing new for the user)."""
        if self.processor is None or self.state is None:
            return out
        return self.processor.process(self.state, out)

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.finished:
                raise StopAsyncIteration
            if not self._pending and self._error is None:
                await self._ready.wait()
            self._ready.clear()
            if self._error is not None:
                self.finished = True
                self._pending = []
                raise self._error
            items, self._pending = self._pending, []
            item = merge_deltas(items)
            if not self.eager:
                item = self.process(item)  # type: ignore[assignment]
            if item is not None:
                self.finished = item.finished
                return item


class AsyncLLM:
    """``async for out in engine.generate(prompt, params, request_id)``: incremental outputs of a request.

    Build it around an engine core (``AsyncLLM(ModelEngineCore(config))``: the step loop runs in a thread of this
    process) or from a config (``AsyncLLM.from_config(model, ..., engine_process=True)`` runs it in a process of
    its own; with ``data_parallel_size=N``, N replicas in processes of their own, each request on the least loaded).
    The step loop starts with :meth:`start` (or the first request) in the running event loop and stops with
    :meth:`shutdown`, which aborts whatever is still in flight. ``async with AsyncLLM(...)`` does both.
    """

    def __init__(self, core: ModelEngineCore | EngineClient, observer: OutputObserver | None = None) -> None:
        self.core: EngineClient = InProcessClient(core) if isinstance(core, ModelEngineCore) else core
        self.engine: ModelEngineCore | None = getattr(self.core, "engine", None)  # None when it runs elsewhere
        self.config: EngineConfig = self.core.config
        self.observer = observer
        self.max_model_len: int = self.config.max_model_len  # type: ignore[assignment]
        # a tokenizer of its own: the event loop and the tokenizer's thread encode, and the output processor
        # decodes, while the step loop runs the engine
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        # One thread, made on first use: long texts are tokenized one at a time, as in vLLM's front-end. Short ones
        # are still tokenized on the event loop meanwhile: without truncation or padding (never set here) encoding
        # only reads the tokenizer's state.
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._streams: dict[str, RequestStream] = {}
        # requests a stop string ended whose engine metrics come with the abort's output: their streams
        self._awaiting_metrics: dict[str, RequestStream] = {}
        self.num_queued = 0  # accepted requests without any output yet (waiting or in their first prefill)
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False  # stop was sent: nothing more is accepted
        self._dead: BaseException | None = None
        # the step loop's own account (steps, time inside step(), its thread's CPU time), for /metrics
        self.account = LoopAccount()

    @classmethod
    def from_config(
        cls,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        *,
        cli_overrides: dict[str, Any] | None = None,
        observer: OutputObserver | None = None,
        engine_process: bool = False,
        **kwargs: Any,
    ) -> AsyncLLM:
        """The engine client :func:`make_engine_client` picks for this config (finished here, once), served."""
        finished = create_engine_config(model, config, cli_overrides=cli_overrides, **kwargs)
        return cls(make_engine_client(finished, engine_process=engine_process), observer)

    # --- life cycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the step loop, bound to the running event loop (idempotent)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self.core.start(self._deliver, self._fail, loop=self._loop)

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop: wait up to ``timeout`` seconds for in-flight requests, abort the rest, stop the step loop."""
        deadline = time.monotonic() + timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not self._closed:  # (a loop that never started still has an engine, or an engine process, to end)
            self._closed = True
            if self._dead is None:
                self.core.submit([(None, "stop", ())])
            await asyncio.to_thread(self.core.join)
            await asyncio.sleep(0)  # let the aborted requests' last outputs reach their streams
        if self._tokenizer_pool is not None:  # work already handed to it finishes (its caller still waits)
            self._tokenizer_pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        """The step loop runs and accepts requests."""
        return self._started and self._dead is None and not self._closed

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # --- requests ---------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenized here (InvalidRequestError for text the tokenizer cannot take)."""
        prompt = unwrap_prompt(prompt)
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        return list(prompt)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; a long text is tokenized off the event loop (:meth:`off_loop`)."""
        return await self.off_loop(len(text), encode_text, self.tokenizer, text, add_special_tokens)

    async def off_loop(self, num_chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, tokenizer work on about ``num_chars`` characters: on the event loop when that
        is short, else in the tokenizer's thread while the event loop serves on."""
        if num_chars <= INLINE_TOKENIZER_CHARS:
            return fn(*args, **kwargs)
        self._check_alive()  # after shutdown the thread takes no more work
        if self._tokenizer_pool is None:
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(fn, *args, **kwargs))

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue one request; its outputs are deltas (``output_kind="delta"``) read from the returned stream.

        Raises InvalidRequestError at once (nothing queued) when the engine rejects the request. ``priority``
        (vLLM's argument) sets ``params.priority``: lower is more urgent under a priority policy.
        ``arrival_time`` (vLLM's argument, ``time.monotonic()``): when the request reached the caller (a server:
        its HTTP request), the start of the request's timeline; default, now.
        """
        validated = time.monotonic()
        params = with_priority(params, priority)
        await self.start()
        self._check_alive()
        prompt = unwrap_prompt(prompt)
        token_ids = await self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = dataclasses.replace(params, output_kind="delta")
        text = prompt if isinstance(prompt, str) else None
        state = self.output_processor.new_request(params, text, token_ids)
        stream = RequestStream(request_id, token_ids, text, self.output_processor, state)
        self._streams[request_id] = stream
        self.num_queued += 1
        stream.stamps.update(received=validated if arrival_time is None else arrival_time, validated=validated,
                             handed=time.monotonic())  # fmt: skip
        try:
            await self._call("add", (token_ids, engine_params(params), request_id))
        except BaseException:
            if self._streams.pop(request_id, None) is stream:
                self.num_queued -= 1
            raise
        return stream

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's incremental outputs (delta text and token ids); the last one has ``finished``.

        Leaving the loop early (``break``, cancellation, an exception) aborts the request. ``priority``: as
        :meth:`add_request`'s.
        """
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.done:
                self.abort_nowait(stream.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are free when this returns); unknown or finished ids are ignored."""
        self._check_alive()
        await self._call("abort", (request_id,))

    def abort_nowait(self, request_id: str, samples: tuple[int, ...] | None = None) -> None:
        """Queue an abort without waiting for it (from ``finally`` blocks and callbacks); ``samples``: of these
        samples only (the request's others go on)."""
        if self.is_running:
            self.core.submit([(None, "abort", (request_id,) if samples is None else (request_id, samples))])

    async def stats(self) -> Any:
        """The engine core's ``stats()``, read between two steps."""
        self._check_alive()
        return await self._call("stats", ())

    # --- plumbing ---------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine's step loop has stopped: {self._dead}")
        if self._closed:
            raise EngineDeadError("the engine is shutting down and accepts no more requests")

    async def _call(self, kind: str, args: tuple) -> Any:
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self.core.submit([(call_id, kind, args)])
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _fail(self, exc: BaseException) -> None:
        logger.error("the step loop failed; the engine serves no more requests: %r", exc)
        self._dead = exc
        error = EngineDeadError(f"the engine's step loop failed: {exc!r}")
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        self.num_queued = 0

    def _deliver(self, results: list, outputs: list[RequestOutput], now: float, account: LoopAccount) -> None:
        """On the event loop: resolve the commands' futures, then hand each output to its stream."""
        self.account = account
        if outputs and self.observer is not None:
            self.observer.delivery_lag(time.monotonic() - now)
        for call_id, result, exc in results:
            future = self._calls.get(call_id)  # None for a command sent without a call id
            if future is not None and not future.done():
                if exc is not None:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        for raw in outputs:
            stream = self._streams.get(raw.request_id)
            if stream is None:
                ended = self._awaiting_metrics.pop(raw.request_id, None) if raw.finished else None
                if ended is not None and raw.metrics is not None and self.observer is not None:
                    self.observer.timeline(RequestTimeline.of(raw.request_id, ended.stamps, raw.metrics))
                continue
            core_finished = raw.finished
            out = stream.process(raw) if stream.eager else raw
            state = stream.state
            if stream.eager and state is not None:  # a stop string may have finished samples the engine still runs
                target = state.abort_target(raw.request_id, out, core_finished)
                if target is not None:
                    self.abort_nowait(*target)
            if out is None:
                continue
            # a stop string: the engine still runs it (an engine process sends metrics with finished outputs only)
            if out.finished and not core_finished and out.metrics is None:
                self._awaiting_metrics[out.request_id] = stream
            self._observe(stream, out, now)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        produced = any(c.token_ids for c in out.outputs)
        if stream.last_token_time is None and (produced or out.finished):
            self.num_queued -= 1
        if produced and stream.stamps["first_token_delivered"] is None:
            stream.stamps["first_token_delivered"] = time.monotonic()
        if produced and self.observer is not None:
            if stream.last_token_time is None:
                self.observer.first_token(now - stream.arrival)
            else:
                self.observer.inter_token(now - stream.last_token_time)
        if produced or out.finished:
            stream.last_token_time = now
        if out.finished:
            stream.stamps["delivered"] = time.monotonic()
        if out.finished and self.observer is not None:
            reasons = {c.finish_reason for c in out.outputs if c.finish_reason is not None}
            reason = "abort" if "abort" in reasons else (reasons.pop() if len(reasons) == 1 else "stop")
            self.observer.finished(now - stream.arrival, reason)
            if out.metrics is not None:
                self.observer.timeline(RequestTimeline.of(out.request_id, stream.stamps, out.metrics))
