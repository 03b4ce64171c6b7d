"""EngineClient: the one interface between the front-ends (``LLMEngine``, ``LLM``, ``AsyncLLM``) and the engines.

A way to run engines is one class implementing it: :class:`~nanovllm_core.engine_client.step_loop.InProcessClient`
(an engine core in this process), :class:`~nanovllm_core.engine_client.step_loop.EngineProcess` (one engine in a
process of its own), and the ``data_parallel_backend`` plugins' clients (``nanovllm-data-parallel``'s
``DataParallelClient``: replicas in processes of their own).
:func:`~nanovllm_core.engine_client.factory.make_engine_client` picks one from the resolved config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineStats, Prompt, tokenize_prompt
from nanovllm_core.engine.model_core import load_tokenizer, read_eos_token_ids
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.loader import load_hf_config
from nanovllm_core.output_processor import OutputProcessor, engine_params
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.sampling_params import SamplingParams, with_priority

logger = logging.getLogger(__name__)

Command = tuple[int | None, str, tuple]
Result = tuple[int | None, Any, BaseException | None]
NewRequest = tuple[Prompt, SamplingParams | None, str | None]  # (prompt, sampling params, request id)

SLOW_STEP_SECONDS = (0.05, 0.2, 1.0)  # LoopAccount.slow_steps counts the steps longer than each
ABORT_WAIT_S = 5.0  # how long abort_requests waits for the engines to confirm


@dataclass
class LoopAccount:
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside engine.step()
    cpu_seconds: float = 0.0  # CPU time of the loop's thread
    emit_seconds: float = 0.0  # wall time handing outputs over (an engine process: pickling, and waiting on the pipe)
    longest_step_seconds: float = 0.0
    # steps longer than each of SLOW_STEP_SECONDS: a stall in the engine (a compilation, a long prompt chunk)
    # against one in the front-end (see the server's event-loop lag)
    slow_steps: list[int] = dataclasses.field(default_factory=lambda: [0] * len(SLOW_STEP_SECONDS))

    @classmethod
    def combined(cls, accounts: list[LoopAccount]) -> LoopAccount:
        """Several loops' accounts as one (data-parallel replicas): sums, and the longest step of all."""
        return cls(
            steps=sum(a.steps for a in accounts),
            step_seconds=sum(a.step_seconds for a in accounts),
            cpu_seconds=sum(a.cpu_seconds for a in accounts),
            emit_seconds=sum(a.emit_seconds for a in accounts),
            longest_step_seconds=max((a.longest_step_seconds for a in accounts), default=0.0),
            slow_steps=[sum(counts) for counts in zip(*(a.slow_steps for a in accounts))]
            or [0] * len(SLOW_STEP_SECONDS),
        )

    def count_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        if seconds > self.longest_step_seconds:
            self.longest_step_seconds = seconds
        for i, limit in enumerate(SLOW_STEP_SECONDS):
            if seconds > limit:
                self.slow_steps[i] += 1


Emit = Callable[[list[Result], list[RequestOutput], float, LoopAccount], None]
Fail = Callable[[BaseException], None]


class EngineClient(ABC):
    """How a front-end talks to engines, wherever they run.

    Push (``AsyncLLM``; what every client implements): :meth:`start` with ``emit(results, outputs, now, account)``
    and ``fail(exc)``, then :meth:`submit` commands, plain data ``(call id or None, kind, args)`` with kind ``add``
    (prompt, sampling params, request id), ``abort`` (request id and optionally the samples to abort, None for all:
    ``EngineCore.abort_request``'s arguments), ``stats``, ``replica_stats`` (data parallel) or
    ``stop`` (aborts what is left and ends the engines). Each command is answered in ``emit``'s results as
    ``(call id, result, exception)``, next to the steps' outputs, the time and the step loop's
    :class:`LoopAccount`; ``fail`` is called once when the engines stop serving. :meth:`join` waits for them to end.

    Pull (``LLMEngine``, ``LLM``): :meth:`add_request` / :meth:`add_requests`, :meth:`step` (the outputs that arrived
    since the last call; waits for one while requests are unfinished), :meth:`abort_request` /
    :meth:`abort_requests`, :meth:`stats`, :meth:`shutdown`. This class implements them over push, with the
    front-end's one :class:`OutputProcessor` (text, stop strings), so a new client (a Ray-backed data-parallel one)
    implements push only; :class:`~nanovllm_core.engine_client.step_loop.InProcessClient` drives its engine in the
    caller's thread instead of a loop's (:meth:`_start_pull`).
    """

    config: EngineConfig

    @abstractmethod
    def start(self, emit: Emit, fail: Fail, loop: Any = None) -> None:
        """Start delivering; with ``loop`` (an asyncio event loop, whose thread calls this) on that loop."""

    @abstractmethod
    def submit(self, commands: list[Command]) -> None:
        """Send commands; never blocks the event loop given to :meth:`start`."""

    @abstractmethod
    def join(self) -> None:
        """Wait for the engines to end (after a ``stop`` command)."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """The engines still run."""

    # --- what a front-end needs beside the engines (loaded here for clients whose engines run elsewhere) ---------

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.config.tokenizer or self.config.model)

    @functools.cached_property
    def hf_config(self) -> Any:
        return load_hf_config(self.config.model)

    @functools.cached_property
    def eos_token_ids(self) -> set[int]:
        return read_eos_token_ids(self.hf_config, self.config.model, self.tokenizer)

    # --- pull, over push ---------------------------------------------------------------------------------------

    def _pull(self) -> _Puller:
        puller = self.__dict__.get("_puller")
        if puller is None:
            puller = self._puller = _Puller(self)
            self._start_pull(puller.inbox)
        return puller

    def _start_pull(self, inbox: Inbox) -> None:
        """Have the engines' answers and outputs delivered to ``inbox``."""
        self.start(inbox.emit, inbox.fail)

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Queue one request and return its id; an invalid request raises InvalidRequestError and queues nothing.
        ``priority``: as ``EngineCore.add_request``'s."""
        request_id, error = self.add_requests([(prompt, with_priority(sampling_params, priority), request_id)])[0]
        if error is not None:
            raise error
        return request_id

    def add_requests(self, requests: list[NewRequest]) -> list[tuple[str, BaseException | None]]:
        """Queue several requests at once; each one's id and, if it was rejected (nothing queued), its error."""
        return self._pull().add(requests)

    def step(self) -> list[RequestOutput]:
        """The outputs of this client's requests that arrived since the last call (finished ones, and for
        ``output_kind`` ``"delta"``/``"cumulative"`` the progress); waits for one while requests are unfinished."""
        return self._pull().step()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request: its final output (which :meth:`step` will not return), or None if the id is unknown or
        its final output was already returned."""
        return self._pull().abort(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort several requests and wait (bounded) until the engines let them go; their outputs are dropped."""
        self._pull().abort_all(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added here whose final output :meth:`step` has not returned yet."""
        puller = self.__dict__.get("_puller")
        return len(puller.requests) if puller is not None else 0

    def stats(self) -> EngineStats:
        return self._pull().call("stats", ())

    def close(self) -> None:
        """Stop and join the engines (idempotent)."""
        if self.alive:
            with contextlib.suppress(OSError, RuntimeError, ValueError):  # gone already, or a stop was sent
                self.submit([(None, "stop", ())])
        self.join()

    def shutdown(self) -> None:
        """Stop the engines (also done when the entry point holding this client is garbage-collected, and at exit);
        a call that waits on them in another thread raises "the engine was shut down"."""
        puller = self.__dict__.get("_puller")
        if puller is not None:
            puller.inbox.fail(RuntimeError(SHUT_DOWN))
            puller.closed = True
        self.close()


SHUT_DOWN = "the engine was shut down (its processes are gone): create a new one"


class Inbox:
    """What the client's readers hand over, for the thread that pulls. Holds no reference to the client or its
    owner, so that the readers do not keep them alive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._results: list[Result] = []
        self._outputs: list[tuple[float, list[RequestOutput]]] = []  # (the engine's clock, what it handed over)
        self.failure: BaseException | None = None
        self.drive: Callable[[], None] | None = None  # an engine in the caller's thread: waiting is stepping it

    def emit(self, results: list[Result], outputs: list[RequestOutput], now: float, account: Any) -> None:
        with self._cond:
            self._results.extend(results)
            if outputs:
                self._outputs.append((now, outputs))
            self._cond.notify()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = exc
            self._cond.notify_all()

    def take(
        self, block: bool, timeout: float | None = None
    ) -> tuple[list[Result], list[tuple[float, list[RequestOutput]]]]:
        """Everything that arrived (waiting for something when ``block``, or running one step when driving an
        engine); raises the failure, if any."""
        if block and self.drive is not None:
            if not (self._results or self._outputs):
                self.drive()
            block = False
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._results or self._outputs or self.failure is not None, timeout)
            results, outputs = self._results, self._outputs
            self._results, self._outputs = [], []
            failure = self.failure
        if failure is not None:
            raise failure
        return results, outputs


class _Puller:
    """The pull surface of a push client: commands out, answers and outputs collected from an :class:`Inbox`, made
    into the user's by an :class:`OutputProcessor` (text, stop strings: a match aborts its sample, or the request once
    every sample is done, in the engine)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.inbox = Inbox()
        self.lock = threading.RLock()
        self.closed = False
        self.call_ids = itertools.count()
        self.request_counter = itertools.count()
        self.results: dict[int, tuple[Any, BaseException | None]] = {}
        self.requests: set[str] = set()  # added here, final output not returned by step() yet
        self.processor = OutputProcessor(client.tokenizer, hold_for_metrics=True)
        self.ready: list[RequestOutput] = []  # outputs not yet returned by step()
        # stop-string-finished requests whose final output waits for the engine's metrics (with the abort's output):
        # until when it waits
        self.held_until: dict[str, float] = {}

    def check_open(self) -> None:
        if self.inbox.failure is not None:
            raise RuntimeError(f"the engine cannot continue: {self.inbox.failure}; shut it down and create a new one")
        if self.closed:
            raise RuntimeError(SHUT_DOWN)

    def prepare(self, request_id: str, prompt: Any, params: SamplingParams | None) -> list[int]:
        """The token ids to send for a prompt; the request is known to the output processor from here on. Text is
        tokenized here, so that routing knows its length and only plain data crosses to the engines; what depends
        on the engine (length, vocabulary, KV cache) the engine checks."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        if type(prompt) is list and set(map(type, prompt)) <= {int}:  # plain token ids: cheaper than the full check
            text, token_ids = None, prompt
        else:
            text, token_ids = tokenize_prompt(self.client.tokenizer, prompt)
        keep = params.truncate_prompt_tokens if params is not None else None
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, token_ids[-keep:]  # as the core keeps them: the text no longer matches
        self.processor.add(request_id, params, text, list(token_ids))
        return token_ids

    def forget(self, request_id: str) -> None:
        self.requests.discard(request_id)
        self.held_until.pop(request_id, None)
        self.processor.forget(request_id)

    def pump(self, block: bool, timeout: float | None = None) -> None:
        """Take what arrived: results kept by call id, outputs of known requests made the user's and queued for
        step(); samples and requests a stop string finished are aborted in the engines. A request's final output
        waits (bounded) for the abort's output, which brings the metrics that streamed outputs cross without."""
        if block and self.held_until:
            wait = max(0.0, min(self.held_until.values()) - time.monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        results, batches = self.inbox.take(block, timeout)
        for call_id, result, exc in results:
            if call_id is not None:
                self.results[call_id] = (result, exc)
        processor = self.processor
        for now, outputs in batches:
            outputs, stopped = processor.process_outputs(outputs, now)
            self.ready += outputs
            if stopped:
                self.client.submit([(None, "abort", target) for target in stopped])
                deadline = time.monotonic() + ABORT_WAIT_S
                self.held_until.update((r, deadline) for r, _ in stopped if processor.holds(r))
        if self.held_until:
            self.release_held()

    def release_held(self) -> None:
        """Forget the holds that ended; give out without metrics the outputs whose abort did not answer in time."""
        now = time.monotonic()
        for request_id, deadline in list(self.held_until.items()):
            if not self.processor.holds(request_id):
                del self.held_until[request_id]
            elif now >= deadline:
                del self.held_until[request_id]
                logger.warning("request %s: its abort brought no metrics in %.0f s", request_id, ABORT_WAIT_S)
                held = self.processor.release(request_id)
                if held is not None:
                    self.ready.append(held)

    def call(self, kind: str, args: tuple) -> Any:
        with self.lock:
            self.check_open()
            call_id = next(self.call_ids)
            self.client.submit([(call_id, kind, args)])
            while call_id not in self.results:
                self.pump(block=True)
            result, exc = self.results.pop(call_id)
        if exc is not None:
            raise exc
        return result

    def add(self, requests: list[NewRequest]) -> list[tuple[str, BaseException | None]]:
        with self.lock:
            self.check_open()
            answers: list[tuple[str, BaseException | None]] = []
            commands: list[Command] = []
            for prompt, params, request_id in requests:
                if request_id is None:
                    request_id = next(r for r in map(str, self.request_counter) if r not in self.requests)
                try:
                    if request_id in self.requests:
                        raise InvalidRequestError(f"request id {request_id!r} is already in use")
                    sent = self.prepare(request_id, prompt, params)
                except InvalidRequestError as exc:
                    answers.append((request_id, exc))
                    continue
                self.requests.add(request_id)
                call_id = next(self.call_ids)
                answers.append((request_id, None))
                commands.append((call_id, "add", (sent, engine_params(params or SamplingParams()), request_id)))
            waiting = {call_id: args[2] for call_id, _, args in commands}  # call id -> request id
            try:
                self.client.submit(commands)
                while any(c not in self.results for c in waiting):
                    self.pump(block=True)
            except BaseException:  # (Ctrl-C) some may have reached the engines: abort them there
                with contextlib.suppress(Exception):
                    self.client.submit([(None, "abort", (r,)) for r in waiting.values()])
                for request_id in waiting.values():
                    self.forget(request_id)
                raise
            errors = {}
            for call_id, request_id in waiting.items():
                exc = self.results.pop(call_id)[1]
                if exc is not None:
                    if not isinstance(exc, InvalidRequestError):
                        raise exc
                    self.forget(request_id)
                    errors[request_id] = exc
            return [(r, errors.get(r, e)) for r, e in answers]

    def step(self) -> list[RequestOutput]:
        with self.lock:
            self.check_open()
            self.pump(block=False)
            while not self.ready and self.requests:
                self.pump(block=True)
                if self.inbox.drive is not None:  # an engine in this thread: one step a call, as vLLM's LLMEngine
                    break
            ready, self.ready = self.ready, []
            for out in ready:
                if out.finished:
                    self.requests.discard(out.request_id)
            return ready

    def abort(self, request_id: str) -> RequestOutput | None:
        with self.lock:
            if request_id not in self.requests:
                return None
            self.call("abort", (request_id,))
            while True:  # its final output came with the abort's answer, or before it
                final = next((o for o in self.ready if o.request_id == request_id and o.finished), None)
                if final is not None:
                    break
                self.pump(block=True)
            self.ready.remove(final)
            self.forget(request_id)
            return final

    def abort_all(self, request_ids: list[str]) -> None:
        with self.lock:
            waiting = {r for r in request_ids if r in self.requests}
            try:
                if waiting and self.inbox.failure is None and not self.closed:
                    self.client.submit([(None, "abort", (r,)) for r in waiting])
                    deadline = time.monotonic() + ABORT_WAIT_S
                    while True:
                        waiting -= {o.request_id for o in self.ready if o.finished}
                        if not waiting or time.monotonic() >= deadline:
                            break
                        self.pump(block=True, timeout=max(0.0, deadline - time.monotonic()))
                    if waiting:
                        logger.warning("%d aborted requests were not confirmed in %.0f s", len(waiting), ABORT_WAIT_S)
            finally:
                gone = set(request_ids)
                self.ready = [o for o in self.ready if o.request_id not in gone]
                for request_id in gone:
                    self.forget(request_id)
