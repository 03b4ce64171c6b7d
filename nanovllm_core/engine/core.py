"""EngineCore: the request table and the one-step loop, independent of how the model runs.

One step: the scheduler picks the work -> the engine checks it -> the runner launches it -> the previous
step's tokens are read (async scheduling) -> the scheduler's ``postprocess`` advances the launched sequences
with placeholder tokens -> without async scheduling, this step's tokens are read now. Reading tokens writes
them over the placeholders, decides stops (EOS, stop tokens) and builds the outputs: token ids, logprob ids and
values, finish reasons; no text (the front-end's ``OutputProcessor`` decodes it and matches stop strings). The
length limit is known in advance, so a sequence that reaches it finishes when its step is launched and its
output is returned once its last token has been read. Synchronous stepping is the same path with nothing left
in flight between steps.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nanovllm_core.config import EngineConfig
from nanovllm_core.errors import InvalidRequestError, SchedulerError
from nanovllm_core.interfaces import Scheduler, SchedulerOutput
from nanovllm_core.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from nanovllm_core.sampling_params import SamplingParams, with_priority
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from nanovllm_core.tokenization import encode_text

if TYPE_CHECKING:
    from nanovllm_core.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]
"""Text, token ids, or vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt), ``{"prompt_token_ids": ids}``
(TokensPrompt)."""


def unwrap_prompt(prompt: Any) -> Any:
    """The text or token ids inside one of vLLM's prompt dicts (``prompt_token_ids`` wins when both are given);
    any other prompt as it is. A dict with other keys, or neither, raises InvalidRequestError."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or not prompt:
        raise InvalidRequestError(
            f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (token ids), as vLLM's TextPrompt and "
            f"TokensPrompt; {'not ' + ', '.join(map(repr, unknown)) if unknown else 'it holds neither'}"
        )
    return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]


def tokenize_prompt(tokenizer: Any, prompt: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt; InvalidRequestError for anything else than text or integer ids."""
    prompt = unwrap_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: give the prompt as a list of token ids")
        return prompt, encode_text(tokenizer, prompt)
    if isinstance(prompt, (list, tuple)):
        if set(map(type, prompt)) <= {int}:  # the common case in one pass; int(t) is t for these
            return None, list(prompt)
        bad = next((t for t in prompt if not _is_int(t)), None)
        if bad is None:
            return None, [int(t) for t in prompt]
        raise InvalidRequestError(f"a token-id prompt holds integers only; it holds {bad!r} ({type(bad).__name__})")
    raise InvalidRequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")


class LaunchedStep(Protocol):
    """What a runner's ``launch`` returns: the step's batch and, once read, its sampled tokens."""

    batch: SchedulerOutput

    def tokens(self) -> list[int | None]: ...


class StepRunner(Protocol):
    def launch(self, batch: SchedulerOutput, in_flight: Any | None = None) -> LaunchedStep: ...


@dataclass
class EngineStats:
    """A snapshot of the engine (``EngineCore.stats()``); counters are totals since start-up."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int  # of those, tokens found
    num_prompt_tokens: int  # prompt tokens computed (recomputation after preemption included)
    num_generation_tokens: int
    num_finished_requests: int
    num_cuda_graph_steps: int = 0  # steps replayed from CUDA graphs (the rest ran eagerly)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Request:
    """One request: its ``n`` samples (sequences), what was already returned of each, and its metrics."""

    def __init__(
        self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams, hold_siblings: bool
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = token_ids
        self.params = params
        self.seqs = [Sequence(token_ids, params, request_id, index=i) for i in range(params.n)]
        # Samples 2..n start once the first has computed the prompt: they then find it in the prefix cache.
        self.held_back = self.seqs[1:] if hold_siblings else []
        # structured output: the constraint compiling; until it is done no sample is scheduled
        self.grammar_future: concurrent.futures.Future | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(token_ids))
        self.num_finished = 0
        self.embedding: list[float] | None = None  # params.embed: set when the prompt's step is read
        self.sent_tokens = [0] * params.n  # delta outputs: how much of each sample was returned
        self.logprobs: list[list[PositionLogprobs]] | None = None
        if params.logprobs is not None:
            self.logprobs = [[] for _ in self.seqs]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class EngineCore:
    """Owns the requests and runs steps on a runner (:class:`~nanovllm_core.engine.model_core.ModelEngineCore`: one
    around a loaded model).

    Thread model: one thread at a time drives ``add_request`` / ``step`` / ``abort_request``; each takes the
    engine's lock, so calls from several threads are serialized, never interleaved inside a step.
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: StepRunner,
        *,
        scheduler_name: str,
        tokenizer: Any = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        vocab_size: int | None = None,
        async_scheduling: bool = False,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        assert config.max_model_len is not None, "max_model_len is resolved before the engine core is built"
        self.config = config
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.step_runner = runner
        self.scheduler_name = scheduler_name
        self.tokenizer = tokenizer  # encodes text prompts and bad words; the core decodes nothing
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.async_scheduling = async_scheduling
        self.structured_output = structured_output
        self._waiting_for_grammar: list[Request] = []  # in the order they came
        self.max_model_len: int = config.max_model_len
        self._requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._in_flight: LaunchedStep | None = None
        self._num_sync_requests = 0  # live requests whose sampling needs every previous token on the host
        self._num_stopped_in_flight = 0  # sequences stopped by a token read after their next step was launched
        self._lock = threading.RLock()
        self._totals = dict.fromkeys(
            ("prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens", "finished"), 0
        )

    # --- requests -------------------------------------------------------------------------------------

    def _make_request(self, prompt: Any, params: SamplingParams | None, request_id: str | None) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        if request_id is None:
            request_id = next(r for r in map(str, self._request_counter) if r not in self._requests)
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"a request id is a non-empty string, not {request_id!r}")
        elif request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, token_ids[-keep:]  # the text no longer matches the ids
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if self.vocab_size is not None:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        encode = None
        if self.tokenizer is not None:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        params = params.for_engine(self.eos_token_ids, self.vocab_size, encode)
        if params.structured_outputs is not None:
            if self.structured_output is None:
                from nanovllm_core.engine.structured_output import no_backend_error

                raise no_backend_error()
            self.structured_output.validate(params.structured_outputs)
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len={max_len} allows at most {max_len - 1} "
                "(one position is needed for the first output token)"
            )
        bm = self.block_manager
        # the last sampled token never needs KV, hence the -1
        needed = bm.num_blocks_for(min(len(token_ids) + params.max_tokens, max_len) - 1)
        if needed > bm.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {needed} KV-cache blocks ({len(token_ids)} prompt + {params.max_tokens} "
                f"max_tokens tokens) but the cache holds {bm.num_blocks}; lower max_tokens or give the cache more "
                "blocks (num_kvcache_blocks, gpu_memory_utilization)"
            )
        return Request(request_id, text, token_ids, params, hold_siblings=self.config.enable_prefix_caching)

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Queue one request and return its id. An invalid request raises InvalidRequestError and queues nothing.

        ``priority`` (vLLM's argument) sets ``sampling_params.priority`` for this request: lower is more urgent
        under a priority policy."""
        sampling_params = with_priority(sampling_params, priority)
        with self._lock:
            request = self._make_request(prompt, sampling_params, request_id)
            self._requests[request.request_id] = request
            if request.params.needs_output_token_ids:
                self._num_sync_requests += 1
            if request.params.structured_outputs is not None:
                assert self.structured_output is not None  # _make_request checked
                request.grammar_future = self.structured_output.compile(request.params.structured_outputs)
                self._waiting_for_grammar.append(request)
            else:
                self._schedule_request(request)
            return request.request_id

    def _schedule_request(self, request: Request) -> None:
        for seq in request.seqs:
            if seq not in request.held_back and not seq.is_finished:
                self.scheduler.add(seq)

    def _admit_compiled(self, wait: bool) -> list[RequestOutput]:
        """Hand the requests whose constraint has compiled to the scheduler, each sample with a grammar of its own.
        ``wait``: nothing else can run, so block until one is ready (briefly: the caller steps again). A
        constraint that failed to compile ends its request (finish reason ``abort``; the error is logged)."""
        pending = self._waiting_for_grammar
        if wait:
            concurrent.futures.wait([r.grammar_future for r in pending], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)  # fmt: skip
        outputs, still = [], []
        for request in pending:
            future = request.grammar_future
            if not future.done():
                still.append(request)
                continue
            request.grammar_future = None
            error = future.exception()
            if error is None:
                for seq in request.seqs:
                    seq.grammar = self.structured_output.new_grammar(future.result())
                self._schedule_request(request)
                continue
            logger.error("request %s: its structured_outputs failed to compile: %s", request.request_id, error)
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    request.num_finished += 1
            outputs.append(self._end(request))
        self._waiting_for_grammar = still
        return outputs

    def abort_request(self, request_id: str, samples: Iterable[int] | None = None) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks. Returns its output so far, or None if unknown.

        ``samples``: stop only these samples (indices; e.g. those a stop string finished in the front-end) and free
        their blocks at once; the request's other samples go on. The output then holds these samples and is the
        request's final one only when nothing of it runs any more."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return None
            if samples is None:
                indices: Any = range(len(request.seqs))
            else:
                indices = list(samples)
                bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < len(request.seqs))]
                if bad or len(set(indices)) != len(indices):
                    raise InvalidRequestError(
                        f"samples {indices} of request {request_id!r}: give distinct indices from 0 to "
                        f"{len(request.seqs) - 1} (its samples)"
                    )
            held_back = request.held_back
            compiling = request.grammar_future is not None  # no sample reached the scheduler yet
            for i in indices:
                seq = request.seqs[i]
                if seq.is_finished and seq.token_ids[-1] != PLACEHOLDER_TOKEN:
                    continue  # its output is complete
                if not seq.is_finished and seq not in held_back and not compiling:
                    self.scheduler.finish(seq)
                while seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # still on the device: dropped
                    seq.token_ids.pop()
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                request.num_finished += 1
            request.held_back = [seq for seq in held_back if not seq.is_finished]
            # sample 0 will not compute the prompt for them
            if request.seqs[0].is_finished and not compiling:
                self._release_held_back(request)
            if not request.finished:
                return self._output(request, indices, final=False)
            if compiling:
                self._waiting_for_grammar.remove(request)
            metrics = request.metrics
            if metrics.finished_time is None:  # its output ended with its last token (or now, if it had none)
                metrics.finished_time = metrics.last_token_time or time.monotonic()
            return self._end(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> EngineStats:
        """Queue lengths, KV-cache use, prefix-cache hits, preemptions and token counters (cheap to call)."""
        t, bm = self._totals, self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=t["prefix_queries"],
            prefix_cache_hits=t["prefix_hits"],
            num_prompt_tokens=t["prompt_tokens"],
            num_generation_tokens=t["generation_tokens"],
            num_finished_requests=t["finished"],
        )

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step. Returns the requests that finished in it and, for requests with
        ``output_kind`` ``"delta"`` or ``"cumulative"``, every request that got new tokens."""
        with self._lock:
            outputs: list[RequestOutput] = []
            if self._waiting_for_grammar:
                idle = self._in_flight is None and not self.scheduler.has_unfinished()
                outputs += self._admit_compiled(wait=idle)
            if self._in_flight is not None and self._num_sync_requests:
                # penalties need the in-flight tokens on the host before the next step is scheduled
                outputs += self._receive(self._in_flight)
                self._in_flight = None
            batch = self.scheduler.schedule()
            if batch.seqs:
                placeholders, num_prompt_tokens = self._check_step(batch)
            elif self._in_flight is None:
                if self.scheduler.has_unfinished():
                    raise SchedulerError(
                        f"scheduler {self.scheduler_name!r} returned an empty step while {self.scheduler.num_waiting} "
                        f"sequences wait and {self.scheduler.num_running} run and nothing is in flight: schedule() "
                        "may return nothing only when nothing can run (every request fits an empty KV cache)"
                    )
                return outputs
            received: list[RequestOutput] | None = None
            if batch.seqs:
                before_sample = None
                if self.structured_output is not None:
                    received, before_sample = self._grammar_bitmask(batch, placeholders)
                extra = {} if before_sample is None else {"before_sample": before_sample}
                launched = self.step_runner.launch(batch, self._in_flight, **extra)
            else:
                launched = None
            if self._in_flight is not None:
                outputs += received if received is not None else self._receive(self._in_flight)
            self._in_flight = None
            if launched is not None:
                self._advance(launched, placeholders, num_prompt_tokens)
                if self.async_scheduling:
                    self._in_flight = launched
                else:
                    outputs += self._receive(launched)
            return outputs

    def _check_step(self, batch: SchedulerOutput) -> tuple[list[int | None], int]:
        """The scheduler's output keeps the invariants the runner relies on (cheap: one pass). Returns, from the
        same pass, what :meth:`_advance` appends to each sequence (a placeholder where the step samples a token)
        and how many of the step's new tokens are prompt tokens."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        placeholders: list[int | None] = []
        num_prompt_tokens = 0
        problem = None
        if len(seqs) != len(counts):
            problem = f"{len(seqs)} sequences but {len(counts)} new-token counts"
        elif len(seqs) > self.config.max_num_seqs:
            problem = f"{len(seqs)} sequences; max_num_seqs is {self.config.max_num_seqs}"
        elif sum(counts) > self.config.max_num_batched_tokens:
            problem = f"{sum(counts)} new tokens; max_num_batched_tokens is {self.config.max_num_batched_tokens}"
        elif len(set(seqs)) != len(seqs):  # a Sequence hashes by identity
            problem = "a sequence twice"
        else:
            capacity = self.block_manager.block_size
            finished = SequenceStatus.FINISHED
            append = placeholders.append
            for seq, n in zip(seqs, counts):
                start = seq.num_computed_tokens
                end = start + n
                num_tokens = len(seq.token_ids)
                if start < seq.num_prompt_tokens:
                    num_prompt_tokens += n
                append(PLACEHOLDER_TOKEN if end == num_tokens else None)
                if n < 1 or end > num_tokens or seq.status is finished:
                    problem = (
                        f"{n} new tokens for {seq!r} (allowed: 1 to its {seq.num_uncomputed_tokens} uncomputed "
                        "tokens, for an unfinished sequence)"
                    )
                    break
                if len(seq.block_table) * capacity < end:
                    problem = (
                        f"{seq!r} computes up to token {end} but its block table holds "
                        f"{len(seq.block_table) * capacity} tokens (allocate before scheduling)"
                    )
                    break
                if seq.num_cached_prompt_tokens is None:
                    self._first_scheduled(seq)
                if start < seq.num_prompt_tokens <= end:
                    self._prompt_scheduled(seq)
        if problem is not None:
            raise SchedulerError(f"scheduler {self.scheduler_name!r} scheduled {problem}")
        return placeholders, num_prompt_tokens

    def _grammar_bitmask(
        self, batch: SchedulerOutput, placeholders: list[int | None]
    ) -> tuple[list[RequestOutput] | None, Any]:
        """The allowed tokens of the step's constrained rows that sample.

        With nothing in flight every grammar has accepted its sequence's last token: the bitmask goes with the
        batch (``grammar_bitmask``). With a step in flight (async scheduling) its tokens are not read yet, so the
        runner calls the returned ``before_sample`` once this step's forward is queued: it reads the step in
        flight (its outputs land in the returned list), advances the grammars and fills the bitmask while the
        device runs the forward. Returns (that list or None, ``before_sample`` or None)."""
        rows = [i for i, (seq, token) in enumerate(zip(batch.seqs, placeholders))
                if token is not None and seq.grammar is not None]  # fmt: skip
        if not rows:
            return None, None
        manager, in_flight = self.structured_output, self._in_flight
        if in_flight is None:
            batch.grammar_bitmask = (rows, manager.bitmask(batch.seqs, rows))
            return None, None
        received: list[RequestOutput] = []

        def before_sample() -> tuple[list[int], Any]:
            received.extend(self._receive(in_flight))
            return rows, manager.bitmask(batch.seqs, rows)

        return received, before_sample

    def _prompt_scheduled(self, seq: Sequence) -> None:
        metrics = self._requests[seq.request_id].metrics
        if metrics.prompt_scheduled_time is None:
            metrics.prompt_scheduled_time = time.monotonic()

    def _first_scheduled(self, seq: Sequence) -> None:
        seq.num_cached_prompt_tokens = seq.num_computed_tokens  # the prefix claimed from the cache
        self._totals["prefix_queries"] += seq.num_prompt_tokens
        self._totals["prefix_hits"] += seq.num_computed_tokens
        metrics = self._requests[seq.request_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.monotonic()
            metrics.num_cached_tokens = seq.num_computed_tokens

    def _advance(self, launched: LaunchedStep, placeholders: list[int | None], num_prompt_tokens: int) -> None:
        """Postprocess a launched step with ``placeholders`` (:meth:`_check_step`'s) for the sampled tokens; finish
        length-limited ones. ``num_prompt_tokens``: :meth:`_check_step`'s count of the step's prompt tokens.

        This and :meth:`_receive` run for every sequence of every step: plain loops, few calls.
        """
        batch = launched.batch
        seqs, counts = batch.seqs, batch.num_new_tokens
        if self._num_stopped_in_flight:  # stopped by a token read after it was scheduled: not advanced
            self._num_stopped_in_flight = 0
            live = [i for i, seq in enumerate(seqs) if seq.status is not SequenceStatus.FINISHED]
            seqs, counts = [seqs[i] for i in live], [counts[i] for i in live]
            placeholders = [placeholders[i] for i in live]
            num_prompt_tokens = sum(
                [n for seq, n in zip(seqs, counts) if seq.num_computed_tokens < seq.num_prompt_tokens]
            )
            batch = SchedulerOutput(seqs, counts)
        self._totals["prompt_tokens"] += num_prompt_tokens
        self.scheduler.postprocess(batch, placeholders)
        max_len = self.max_model_len
        for seq, token in zip(seqs, placeholders):
            if token is None:
                continue
            num_tokens = len(seq.token_ids)
            num_completion_tokens = num_tokens - seq.num_prompt_tokens
            if num_completion_tokens >= seq.sampling_params.max_tokens or num_tokens >= max_len:
                self._finish(seq, "length")
            if num_completion_tokens == 1 and seq.index == 0:
                self._release_held_back(self._requests[seq.request_id])

    def _release_held_back(self, request: Request) -> None:
        for seq in request.held_back:
            self.scheduler.add(seq)
        request.held_back = []

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _receive(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (waits for the device), put them in place, decide stops, build outputs."""
        tokens = launched.tokens()
        sample_logprobs = launched.logprobs() if getattr(launched, "wants_logprobs", False) else None
        prompt_logprobs = launched.prompt_logprobs() if getattr(launched, "wants_prompt_logprobs", False) else None
        embeddings = launched.embeddings() if getattr(launched, "wants_embeddings", False) else None
        now = time.monotonic()
        requests, eos, stopped = self._requests, self.eos_token_ids, SequenceStatus.FINISHED
        finished: dict[str, Request] = {}
        streamed: dict[str, tuple[Request, list[int]]] = {}
        num_received = 0
        seqs = launched.batch.seqs
        if prompt_logprobs:  # apart: nothing below reads them
            for row, entries in prompt_logprobs.items():
                self._add_prompt_logprobs(seqs[row], entries, launched.prompt_positions[row])
        for row, seq, token in zip(itertools.count(), seqs, tokens):  # cheaper than enumerate(zip(...)) per row
            if token is None:
                continue  # a prompt chunk short of its end
            token_ids = seq.token_ids
            if token_ids[-1] != PLACEHOLDER_TOKEN:
                continue  # stopped or aborted since it was launched
            token_ids[-1] = token
            num_received += 1
            request = requests[seq.request_id]
            if embeddings and row in embeddings:
                request.embedding = embeddings[row]
            params = request.params
            if seq.grammar is not None and self._advance_grammar(seq, token):
                pass
            elif ((token in eos and not params.ignore_eos) or params.stop_token_ids) and (
                reason := self._token_stop(seq)
            ) is not None:
                self._stop(seq, reason)
            if sample_logprobs is not None and request.logprobs is not None and sample_logprobs[row] is not None:
                request.logprobs[seq.index].append(self._position_logprobs(sample_logprobs[row]))
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            if seq.status is stopped:
                request.num_finished += 1
                if request.num_finished == len(request.seqs):
                    finished[request.request_id] = request
                    continue
            if params.output_kind != "final":
                entry = streamed.get(request.request_id)
                if entry is None:
                    streamed[request.request_id] = (request, [seq.index])
                else:
                    entry[1].append(seq.index)
        self._totals["generation_tokens"] += num_received
        outputs = []
        for request, indices in streamed.values():
            if request.request_id not in finished:
                every = request.params.output_kind == "cumulative"
                outputs.append(self._output(request, range(len(request.seqs)) if every else indices, final=False))
        for request in finished.values():
            request.metrics.finished_time = now
            outputs.append(self._end(request))
        return outputs

    def _advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Feed a read token to the sequence's grammar; True when that finished the sequence (the constraint is
        complete, or, which the mask prevents, the token broke it)."""
        grammar = seq.grammar
        accepted = grammar.accept_tokens(seq.request_id, (token,))
        if accepted and not grammar.is_terminated():
            return False
        if not accepted:
            logger.warning("request %s: token %d is outside its structured_outputs; it ends", seq.request_id, token)
        self._stop(seq, "stop" if accepted else "abort")
        return True

    def _stop(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` on a token just read."""
        if seq.status is SequenceStatus.FINISHED:  # reached its length limit when launched: its last token
            seq.finish_reason = reason
        else:
            self._finish(seq, reason)
            self._num_stopped_in_flight += 1

    def _add_prompt_logprobs(self, seq: Sequence, entries: list[Any], first_position: int) -> None:
        """Prompt logprobs of positions ``first_position...``; a recomputed prompt (preemption) adds nothing twice."""
        request = self._requests.get(seq.request_id)
        if request is None or request.prompt_logprobs is None or seq.index != 0:
            return
        known = request.prompt_logprobs
        for position, entry in enumerate(entries, start=first_position):
            if position == len(known):
                known.append(self._position_logprobs(entry))

    def _end(self, request: Request) -> RequestOutput:
        """Forget a finished request; its final output."""
        del self._requests[request.request_id]
        self._totals["finished"] += 1
        if request.params.needs_output_token_ids:
            self._num_sync_requests -= 1
        return self._output(request, range(len(request.seqs)), final=True)

    def _token_stop(self, seq: Sequence) -> str | None:
        """``"stop"`` when the last token is an EOS or a stop token, else None (stop strings: the front-end's)."""
        params = seq.sampling_params
        if seq.num_completion_tokens < params.min_tokens:
            return None  # EOS and stop tokens were masked
        token = seq.token_ids[-1]
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        return None

    # --- outputs --------------------------------------------------------------------------------------

    @staticmethod
    def _position_logprobs(entry: Any) -> PositionLogprobs | None:
        """A runner's logprobs of one position (token id, logprob, rank, top ids and logprobs) as vLLM's dict, its
        tokens not decoded (the front-end does)."""
        if entry is None:
            return None
        result = {entry.token_id: Logprob(entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank)
        return result

    def _output(self, request: Request, indices: Any, final: bool) -> RequestOutput:
        params = request.params
        delta = params.output_kind == "delta"
        completions = []
        for i in indices:
            seq = request.seqs[i]
            logprobs = request.logprobs[i] if request.logprobs is not None else None
            if delta:  # only what was not sent yet (slices of what is new, not copies of everything)
                sent = request.sent_tokens[i]
                token_ids = seq.token_ids[seq.num_prompt_tokens + sent :]
                if logprobs is not None:
                    logprobs = logprobs[sent:]
                if not final:
                    request.sent_tokens[i] += len(token_ids)
            else:
                token_ids = seq.completion_token_ids
            completions.append(CompletionOutput(i, "", token_ids, seq.finish_reason, seq.stop_reason, None, logprobs))
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=request.seqs[0].num_cached_prompt_tokens or 0,
            metrics=request.metrics,
            prompt_logprobs=request.prompt_logprobs,
            embedding=request.embedding,
        )


def _is_int(value: Any) -> bool:
    """An integer token id: int or an integer-like scalar (numpy, torch), never a bool or a float."""
    return not isinstance(value, (bool, float)) and hasattr(value, "__index__") and type(value).__name__ != "bool_"
