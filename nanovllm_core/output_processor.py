"""The front-end's one output path (vLLM v1's ``OutputProcessor``), used by the pull side of every engine client
(``LLMEngine``, ``LLM``) and by ``AsyncLLM``.

The engine core returns token ids, logprob ids and values, and finish reasons for EOS, stop tokens and length.
This turns them into what the user sees: the text (decoded incrementally while a request streams, at once when it
ends), stop strings (a match finishes the sample with ``finish_reason="stop"``; the caller aborts that sample in the
core, or the whole request once every sample is done, and tokens the core produced after the match are dropped),
the decoded tokens of logprob dicts, the cumulative logprob, and the request's ``output_kind`` (final, delta or
cumulative).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nanovllm_core.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from nanovllm_core.sampling_params import SamplingParams

Decode = Callable[[list[int], bool], str]
AbortTarget = tuple[str, tuple[int, ...] | None]
"""What a stop string asks to abort in the core: (request id, the samples to abort, or None for the whole request);
the arguments of the core's ``abort_request``."""


def _fast_backend(tokenizer: Any) -> Any:
    """The Rust ``tokenizers`` object behind ``tokenizer`` when decoding with it gives what ``tokenizer.decode``
    gives (a fast tokenizer that does not clean up tokenization spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None


def _decode_stream_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer a :class:`DecodeStream` decodes with, or None (no fast backend, or a ``tokenizers`` older
    than 0.21, which has no ``DecodeStream``)."""
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return None
    return _fast_backend(tokenizer)


def decoder_of(tokenizer: Any) -> Decode:
    """``decode(token_ids, skip_special_tokens)`` for ``tokenizer``: straight to the Rust decoder where that gives the
    same result (``transformers``' own ``decode`` first walks the id list in Python, which costs more than the decode
    itself)."""
    backend = _fast_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Appends the text of new tokens without decoding the whole completion again (for tokenizers without a Rust
    backend that decodes as they do).

    Each update decodes a short window: the tokens already shown since the last emitted text (``prefix``), once
    alone and once with the new tokens; the difference is the new text. A window that ends inside a multi-byte
    character decodes to U+FFFD and is held back until the character completes.
    """

    def __init__(self, decode: Decode | None, start: int, skip_special_tokens: bool) -> None:
        self.decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = start
        self.read_offset = start
        self.text = ""

    def update(self, token_ids: list[int]) -> None:
        if self.decode is None or len(token_ids) <= self.read_offset:
            return
        decode, skip = self.decode, self.skip_special_tokens
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip)
        full = decode(token_ids[self.prefix_offset :], skip)
        # New tokens that add no text at all (skipped special tokens, ids the tokenizer does not know) move the
        # window on too: kept in it, they would make every later decode longer, up to the whole completion.
        if full == prefix or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)


class DecodeStream:
    """``IncrementalDetokenizer``'s interface over the ``tokenizers`` library's ``DecodeStream`` (the Rust decoder
    keeps the window): the same text, in about half the time per token."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream as RustDecodeStream

        self.backend = backend
        self.stream = RustDecodeStream(skip_special_tokens=skip_special_tokens)
        self.read_offset = 0
        self.text = ""

    def update(self, token_ids: list[int]) -> None:
        self.push(token_ids[self.read_offset :])

    def push(self, new_token_ids: list[int]) -> str:
        """Decode the tokens that follow those seen so far; their text."""
        step, backend = self.stream.step, self.backend
        if len(new_token_ids) == 1:  # a streamed step's one token
            text = step(backend, new_token_ids[0]) or ""
        else:
            text = "".join(piece for token_id in new_token_ids if (piece := step(backend, token_id)) is not None)
        self.read_offset += len(new_token_ids)
        self.text += text
        return text


@dataclass(slots=True)
class _Sample:
    """What the front-end knows of one sample of a request."""

    token_ids: list[int] = field(default_factory=list)  # the completion so far
    logprobs: list[PositionLogprobs | None] | None = None
    stream: IncrementalDetokenizer | DecodeStream | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # delta outputs: how much was returned
    sent_text: int = 0


@dataclass(slots=True)
class _Stopped:
    """A request a stop string finished here while the core still runs it (its outputs are dropped until the core's
    final one, the abort's, arrives)."""

    num_late_tokens: int = 0  # tokens the core produced after the match
    # the user's final output when the core's output that matched came without metrics (an engine process sends
    # them with finished outputs only): held until the core's final output brings them
    held: RequestOutput | None = None
    match_time: float | None = None  # the engine's clock when the output that matched was handed over


class RequestState:
    """One request in the front-end: its parameters, prompt and samples."""

    def __init__(self, params: SamplingParams, prompt: str | None, prompt_token_ids: list[int] | None) -> None:
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # the core returns every new token (delta) when stop strings must be matched here, or for cumulative outputs
        self.accumulates = engine_output_kind(params) == "delta"
        self.samples = [_Sample(logprobs=[] if params.logprobs is not None else None) for _ in range(params.n)]
        self.num_finished = 0
        self.stopped: list[int] = []  # samples a stop string finished here that the core still runs (see abort_target)
        # a stream's common case, which OutputProcessor.process serves on a short path: one sample, delta outputs,
        # no stop strings, no logprobs
        self.plain_stream = (
            params.n == 1 and params.output_kind == "delta" and params.logprobs is None and not params.stop_strings
        )

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)

    def abort_target(self, request_id: str, out: RequestOutput | None, core_finished: bool) -> AbortTarget | None:
        """What to abort in the core once :meth:`OutputProcessor.process` made ``out`` of the core's output
        (``core_finished``: that output was the core's last): the whole request when a stop string finished it
        here, else the samples a stop string finished here (the others go on), else nothing."""
        samples, self.stopped = self.stopped, []
        if out is not None and out.finished:
            return None if core_finished else (request_id, None)
        return (request_id, tuple(samples)) if samples else None


def _metrics_at_match(metrics: RequestMetrics | None, stopped: _Stopped) -> RequestMetrics | None:
    """The core's final metrics of a request a stop string finished here, as they stood when the match finished it
    (as an engine in this process reports them): without the tokens the core produced since, and finished then."""
    if metrics is None:
        return None
    if stopped.num_late_tokens:
        metrics.num_generation_tokens -= stopped.num_late_tokens
        if stopped.match_time is not None and metrics.last_token_time is not None:
            metrics.last_token_time = min(stopped.match_time, metrics.last_token_time)
    metrics.finished_time = metrics.last_token_time
    return metrics


def _fill_prompt(state: RequestState, raw: RequestOutput) -> None:
    if raw.prompt is None:
        raw.prompt = state.prompt  # the engine got token ids; the caller gave text
    if not raw.prompt_token_ids and state.prompt_token_ids:
        raw.prompt_token_ids = state.prompt_token_ids  # not sent back by an engine process


def engine_output_kind(params: SamplingParams) -> str:
    """The ``output_kind`` the core is asked for: every new token (``"delta"``) where stop strings are matched here
    or the user wants cumulative outputs, else the user's own."""
    if params.output_kind == "cumulative" or (params.stop_strings and params.detokenize):
        return "delta"
    return params.output_kind


def engine_params(params: Any) -> Any:
    """``params`` as sent to the engine core (see :func:`engine_output_kind`); anything else than SamplingParams
    unchanged, for the core to reject."""
    if not isinstance(params, SamplingParams):
        return params
    kind = engine_output_kind(params)
    return params if kind == params.output_kind else replace(params, output_kind=kind)


class OutputProcessor:
    """Makes the user's ``RequestOutput`` from the core's: :meth:`new_request` then :meth:`process` each output of
    the request (per-request state held by the caller), or :meth:`add` and :meth:`process_outputs` (held here)."""

    def __init__(self, tokenizer: Any, hold_for_metrics: bool = False) -> None:
        """``hold_for_metrics``: hold the final output of a request a stop string finished here, when the core's
        output that matched came without metrics (an engine process sends them with finished outputs only), until
        the core's final output brings them (see :meth:`process_outputs`)."""
        self.tokenizer = tokenizer
        self.hold_for_metrics = hold_for_metrics
        self._decode = decoder_of(tokenizer) if tokenizer is not None else None
        self._backend = _decode_stream_backend(tokenizer) if tokenizer is not None else None
        self._token_text: dict[int, str] = {}
        self.requests: dict[str, RequestState] = {}
        self._stopped: dict[str, _Stopped] = {}

    # --- requests held here ----------------------------------------------------------------------------------

    def add(
        self, request_id: str, params: SamplingParams | None, prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        self.requests[request_id] = self.new_request(params or SamplingParams(), prompt, prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._stopped.pop(request_id, None)

    def holds(self, request_id: str) -> bool:
        """A stop string finished the request and its final output waits for the core's metrics."""
        stopped = self._stopped.get(request_id)
        return stopped is not None and stopped.held is not None

    def release(self, request_id: str) -> RequestOutput | None:
        """The held final output of a request, without metrics (the core's final output did not come); what the
        core still sends for it is dropped."""
        stopped = self._stopped.get(request_id)
        if stopped is None:
            return None
        held, stopped.held = stopped.held, None
        return held

    def process_outputs(
        self, outputs: list[RequestOutput], now: float | None = None
    ) -> tuple[list[RequestOutput], list[AbortTarget]]:
        """The user's outputs (unfinished first, then finished, as the core orders them) and what stop strings finished
        here, to abort in the core (see :meth:`RequestState.abort_target`). ``now``: the engine's clock when it handed
        these outputs over. With ``hold_for_metrics``, a stop-finished output that came without metrics is held (see
        :meth:`holds`) and returned with the core's final output, its metrics as they stood at the match."""
        done: list[RequestOutput] = []
        streamed: list[RequestOutput] = []
        to_abort: list[AbortTarget] = []
        for raw in outputs:
            request_id = raw.request_id
            stopped = self._stopped.get(request_id)
            if stopped is not None:
                stopped.num_late_tokens += sum(len(c.token_ids) for c in raw.outputs)
                if raw.finished:
                    del self._stopped[request_id]
                    if stopped.held is not None:
                        stopped.held.metrics = _metrics_at_match(raw.metrics, stopped)
                        done.append(stopped.held)
                continue
            state = self.requests.get(request_id)
            if state is None:
                continue
            core_finished = raw.finished
            out = self.process(state, raw)
            target = state.abort_target(request_id, out, core_finished)
            if target is not None:
                to_abort.append(target)
            if out is None:
                continue
            if out.finished:
                del self.requests[request_id]
                if not core_finished:
                    if out.metrics is None and self.hold_for_metrics:
                        self._stopped[request_id] = _Stopped(held=out, match_time=now)
                        continue
                    self._stopped[request_id] = _Stopped()
                done.append(out)
            else:
                streamed.append(out)
        return streamed + done, to_abort

    # --- one request -----------------------------------------------------------------------------------------

    def new_request(
        self, params: SamplingParams, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> RequestState:
        return RequestState(params, prompt, prompt_token_ids)

    def process(self, state: RequestState, raw: RequestOutput) -> RequestOutput | None:
        """The user's output for the core's output ``raw`` of this request (``raw`` itself, filled in), or None when
        there is nothing new for the user (tokens the core produced after a stop string matched)."""
        if state.plain_stream and not raw.finished and raw.prompt_logprobs is None and len(raw.outputs) == 1:
            c = raw.outputs[0]
            if c.finish_reason is None and c.logprobs is None:
                return self._plain_delta(state, raw, c)
        params = state.params
        changed: list[CompletionOutput] = []
        for c in raw.outputs:
            sample = state.samples[c.index]
            if sample.finish_reason is not None:
                continue  # a stop string finished it here: what the core produced since is dropped
            if state.accumulates:
                self._append(sample, params, c)
            else:
                sample.token_ids = c.token_ids
                sample.logprobs = c.logprobs
            if c.finish_reason is not None:
                if sample.finish_reason is None:
                    sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
            elif sample.finish_reason is not None:  # a stop string, here: the core still runs the sample
                state.stopped.append(c.index)
            if sample.finish_reason is not None:
                state.num_finished += 1
            changed.append(c)
        if not changed and not raw.finished:
            return None
        finished = state.finished
        if params.output_kind == "final" and not finished:
            return None
        if raw.prompt_logprobs is not None:
            for position in raw.prompt_logprobs:
                self._decode_logprobs(position)
        if params.output_kind == "delta" and not finished:
            raw.outputs = [self._fill(state, c, False) for c in changed]
        else:
            given = {c.index: c for c in changed}
            every = range(len(state.samples))
            raw.outputs = [self._fill(state, given.get(i) or CompletionOutput(i, "", []), finished) for i in every]
        _fill_prompt(state, raw)
        metrics = raw.metrics
        if finished and not raw.finished and metrics is not None and metrics.finished_time is None:
            metrics.finished_time = metrics.last_token_time  # finished here, by a stop string
        raw.finished = finished
        return raw

    def _plain_delta(self, state: RequestState, raw: RequestOutput, c: CompletionOutput) -> RequestOutput:
        """What :meth:`process` makes of an unfinished delta output of a ``plain_stream`` request, in fewer steps:
        the new tokens and their text."""
        sample = state.samples[0]
        sample.token_ids += c.token_ids
        if not state.params.detokenize or self._decode is None:
            c.text = ""
        elif self._backend is not None:
            c.text = self._stream(sample, state.params).push(c.token_ids)
        else:
            stream = self._stream(sample, state.params)
            stream.update(sample.token_ids)
            c.text = stream.text[sample.sent_text :]
        sample.sent_text += len(c.text)
        sample.sent_tokens += len(c.token_ids)
        _fill_prompt(state, raw)
        return raw

    def _append(self, sample: _Sample, params: SamplingParams, c: CompletionOutput) -> None:
        """Add the core's new tokens, one at a time where stop strings are matched on the text as it grows."""
        logprobs = c.logprobs
        ids = sample.token_ids
        if not (params.stop_strings and params.detokenize):
            ids += c.token_ids
            if sample.logprobs is not None and logprobs is not None:
                sample.logprobs += logprobs
            return
        last = len(c.token_ids) - 1
        for k, token_id in enumerate(c.token_ids):
            ids.append(token_id)
            if sample.logprobs is not None and logprobs is not None and k < len(logprobs):
                sample.logprobs.append(logprobs[k])
            # the core finished the sample on an EOS or stop token: that token ends it, whatever its text
            if not (k == last and c.finish_reason == "stop"):
                stop = self._stop_string(sample, params)
                if stop is not None:
                    sample.finish_reason, sample.stop_reason = "stop", stop
                    return

    def _stop_string(self, sample: _Sample, params: SamplingParams) -> str | None:
        """The stop string that the newest token completes, if any (none before ``min_tokens`` tokens)."""
        stream = self._stream(sample, params)
        before = len(stream.text)
        stream.update(sample.token_ids)
        if len(sample.token_ids) < params.min_tokens:
            return None
        text = stream.text
        for stop in params.stop_strings:
            if text.find(stop, max(0, before - len(stop) + 1)) >= 0:
                return stop
        return None

    def _stream(self, sample: _Sample, params: SamplingParams) -> IncrementalDetokenizer | DecodeStream:
        if sample.stream is None:
            skip = params.skip_special_tokens
            if self._backend is not None:
                sample.stream = DecodeStream(self._backend, skip)
            else:
                sample.stream = IncrementalDetokenizer(self._decode, 0, skip)
        return sample.stream

    def _fill(self, state: RequestState, c: CompletionOutput, request_finished: bool) -> CompletionOutput:
        """``c`` (a core's completion, or a new one) as the user's: text, token ids and logprobs of the output kind."""
        params = state.params
        sample = state.samples[c.index]
        if not params.detokenize or self._decode is None:
            text = ""
        elif sample.finish_reason is not None:
            text = self._final_text(sample, params)
        else:
            stream = self._stream(sample, params)
            stream.update(sample.token_ids)
            text = stream.text
            if params.stop_strings and not params.include_stop_str_in_output:
                # hold back what could still turn out to be the start of a stop string
                text = text[: max(sample.sent_text, len(text) - max(map(len, params.stop_strings)) + 1)]
        token_ids, logprobs = sample.token_ids, sample.logprobs
        delta = params.output_kind == "delta"
        if logprobs is not None:
            for position in logprobs[sample.sent_tokens if delta else 0 :]:
                self._decode_logprobs(position)
            c.cumulative_logprob = sum(p[t].logprob for p, t in zip(logprobs, token_ids) if p and t in p)
        if delta:  # only what was not sent yet
            sent = sample.sent_tokens
            token_ids = token_ids[sent:]
            text = text[sample.sent_text :]
            if logprobs is not None:
                logprobs = logprobs[sent:]
            if not request_finished:
                sample.sent_text += len(text)
                sample.sent_tokens += len(token_ids)
        elif state.accumulates:  # the sample's own lists go on growing
            token_ids = list(token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        c.text, c.token_ids, c.logprobs = text, token_ids, logprobs
        c.finish_reason, c.stop_reason = sample.finish_reason, sample.stop_reason
        return c

    def _final_text(self, sample: _Sample, params: SamplingParams) -> str:
        assert self._decode is not None
        text = self._decode(sample.token_ids, params.skip_special_tokens)
        stop = sample.stop_reason
        if isinstance(stop, str):
            # the stop string that ended it; with min_tokens the same string may also stand earlier in the text
            cut = text.rfind(stop) if params.min_tokens else text.find(stop)
            if cut >= 0:
                text = text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        return text

    def _decode_logprobs(self, position: PositionLogprobs | None) -> None:
        if position is None or self.tokenizer is None:
            return
        cache = self._token_text
        for token_id, logprob in position.items():
            if logprob.decoded_token is None:
                text = cache.get(token_id)
                if text is None:
                    text = cache[token_id] = self.tokenizer.decode([token_id])
                logprob.decoded_token = text
