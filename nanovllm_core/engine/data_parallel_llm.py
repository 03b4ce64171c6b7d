"""The offline API over data-parallel replicas: what ``LLM(model, data_parallel_size=N)`` returns.

:class:`DataParallelLLM` keeps :class:`~nanovllm_core.engine.llm.LLM`'s semantics over a
:class:`~nanovllm_core.engine.data_parallel.DataParallelCore`: the prompts of one call go out together, placed on
the replicas by their work, and only final outputs come back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nanovllm_core.engine.core import EngineStats, Prompt
from nanovllm_core.engine.data_parallel import DataParallelCore
from nanovllm_core.engine.llm import LLM, _error_output
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.loader import load_hf_config
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.sampling_params import SamplingParams, with_priority
from nanovllm_core.serving.step_loop import Command, Result

logger = logging.getLogger(__name__)

__all__ = ["DataParallelLLM"]


class _Inbox:
    """What the replicas' readers hand over, for the thread that drives :class:`DataParallelLLM`. Holds no
    reference to the LLM, so that the readers do not keep it alive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._results: list[Result] = []
        self._outputs: list[RequestOutput] = []
        self.failure: BaseException | None = None

    def emit(self, results: list[Result], outputs: list[RequestOutput], now: float, account: Any) -> None:
        with self._cond:
            self._results.extend(results)
            self._outputs.extend(outputs)
            self._cond.notify()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = exc
            self._cond.notify_all()

    def take(self, block: bool, timeout: float | None = None) -> tuple[list[Result], list[RequestOutput]]:
        """Everything that arrived (waiting for something when ``block``); raises the failure, if any."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._results or self._outputs or self.failure is not None, timeout)
            results, outputs = self._results, self._outputs
            self._results, self._outputs = [], []
            failure = self.failure
        if failure is not None:
            raise failure
        return results, outputs


class DataParallelLLM(LLM):
    """``LLM(model, data_parallel_size=N)``: N engine replicas in processes of their own, one ``LLM`` API.

    ``generate`` and ``chat`` behave as :class:`LLM`'s: outputs in prompt order, an error output for a prompt that
    cannot be served, nothing left queued after an exception. The prompts of one call are sent together, placed
    on the replicas by their work (prompt plus output budget), and only final outputs come back.
    ``add_request`` / ``step`` / ``abort_request`` work too, with one difference: the replicas run on their
    own, so ``step()`` returns the outputs that arrived since the last call (waiting for at least one while
    requests are unfinished) instead of running one step. What lives inside one engine (``runner``,
    ``scheduler``, ``step_stats``, ...) is not available here: ask the replicas through ``stats()`` and
    ``replica_stats()``.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | None = None,
        *,
        cli_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        core = DataParallelCore(model, config, cli_overrides, **kwargs)
        self._core = core
        self._finalizer = weakref.finalize(self, core.close)
        try:
            self.config = core.config
            self.data_parallel_size = core.data_parallel_size
            self.hf_config = load_hf_config(self.config.model)
            self.tokenizer = LLMEngine._load_tokenizer(self.config.tokenizer or self.config.model)
            self.max_model_len: int = self.config.max_model_len  # type: ignore[assignment]
            self.eos_token_ids = self._eos_token_ids()
            self._lock = threading.RLock()  # one caller at a time, as LLM
            self._inbox = _Inbox()
            self._call_ids = itertools.count()
            self._generate_calls = itertools.count()
            self._request_counter = itertools.count()
            self._results: dict[int, tuple[Any, BaseException | None]] = {}
            self._requests: dict[str, tuple[str | None, list[int] | None]] = {}  # add_request's: (text, ids)
            self._ready: list[RequestOutput] = []  # their outputs not yet returned by step()
            core.start(self._inbox.emit, self._inbox.fail)
        except BaseException:
            self._finalizer()
            raise

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{name!r} is not available with data_parallel_size > 1: the engines run in {type(self).__name__}'s "
            "replica processes. Available: generate, chat, add_request, step, abort_request, "
            "has_unfinished_requests, stats, replica_stats, shutdown, config, tokenizer, hf_config"
        )

    # --- requests ---------------------------------------------------------------------------------------

    def _generate(
        self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        self._check_open()
        prefix = f"generate-{next(self._generate_calls)}-"  # stale outputs of an earlier call never match
        results: list[RequestOutput | None] = [None] * len(prompts)
        shown: list[tuple[str | None, list[int] | None]] = [(None, None)] * len(prompts)
        calls: dict[int, int] = {}
        commands: list[Command] = []
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            if isinstance(params, SamplingParams) and params.output_kind != "final":
                params = dataclasses.replace(params, output_kind="final")
            try:
                sent, shown[i] = self._prepare(prompt, params)
            except InvalidRequestError as exc:
                logger.warning("prompt %d rejected: %s", i, exc)
                results[i] = _error_output(f"generate-{i}", prompt, str(exc))
                bar.update(1)
                continue
            call_id = next(self._call_ids)
            calls[call_id] = i
            commands.append((call_id, "add", (sent, params, f"{prefix}{i}")))
        left = len(commands)
        produced, start = 0, time.perf_counter()
        try:
            self._core.submit(commands)
            while left:
                for out in self._pump(block=True):
                    if not out.request_id.startswith(prefix) or not out.finished:
                        continue
                    i = int(out.request_id[len(prefix) :])
                    if results[i] is not None:
                        continue
                    out.request_id = f"generate-{i}"
                    self._restore(out, shown[i])
                    results[i] = out
                    left -= 1
                    produced += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                for call_id in [c for c in calls if c in self._results]:
                    i = calls.pop(call_id)
                    _, exc = self._results.pop(call_id)
                    if exc is None:
                        continue
                    if not isinstance(exc, InvalidRequestError):
                        raise exc
                    logger.warning("prompt %d rejected: %s", i, exc)
                    results[i] = _error_output(f"generate-{i}", prompts[i], str(exc))
                    left -= 1
                    bar.update(1)
                if use_tqdm:
                    bar.set_postfix_str(f"output {produced / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
        except BaseException:
            unfinished = [f"{prefix}{i}" for i, r in enumerate(results) if r is None]
            self._abort_and_wait(unfinished, {call_id: f"{prefix}{i}" for call_id, i in calls.items()})
            raise
        finally:
            bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _prepare(self, prompt: Any, params: Any) -> tuple[list[int], tuple[str | None, list[int] | None]]:
        """The token ids to send for a prompt, and (text, token ids) to put back into its outputs. Text is
        tokenized here (the tokenizer is the replicas'), so that routing knows its length and only plain data
        crosses the pipe; what depends on the engine (length, vocabulary, KV cache) the replica checks."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        if type(prompt) is list and set(map(type, prompt)) <= {int}:  # plain token ids: cheaper than the full check
            return prompt, (None, list(prompt))
        text, token_ids = self._tokenize(prompt)
        return token_ids, (text, token_ids)

    @staticmethod
    def _restore(out: RequestOutput, shown: tuple[str | None, list[int] | None]) -> None:
        text, token_ids = shown
        if out.prompt is None:
            out.prompt = text
        if not out.prompt_token_ids and token_ids:
            out.prompt_token_ids = token_ids

    def _abort_and_wait(self, request_ids: list[str], adds: dict[int, str], timeout: float = 5.0) -> None:
        """After an exception in generate: abort its unfinished requests and wait (bounded) until every replica
        has let them go, so that nothing of the call stays queued. ``adds``: the add calls whose answer was not
        read yet (a rejected add leaves nothing to wait for)."""
        if self._inbox.failure is not None or not request_ids or not self._finalizer.alive:
            return
        waiting = set(request_ids)
        try:
            self._core.submit([(None, "abort", (r,)) for r in request_ids])
            deadline = time.monotonic() + timeout
            while waiting and time.monotonic() < deadline:
                for out in self._pump(block=True, timeout=max(0.0, deadline - time.monotonic())):
                    if out.finished:
                        waiting.discard(out.request_id)
                for call_id in [c for c in adds if c in self._results]:
                    _, exc = self._results.pop(call_id)
                    if exc is not None:  # rejected: it never was in a replica
                        waiting.discard(adds[call_id])
                    del adds[call_id]
        except Exception:  # noqa: BLE001 - the original exception is what the caller must see
            logger.warning("aborting the rest of a generate call failed", exc_info=True)
        if waiting:
            logger.warning("%d aborted requests were not confirmed by their replicas in %.0f s", len(waiting), timeout)

    def _pump(self, block: bool, timeout: float | None = None) -> list[RequestOutput]:
        """Take what arrived: results are kept by call id, add_request's outputs queued for step(); returns the
        other outputs (generate's)."""
        results, outputs = self._inbox.take(block, timeout)
        for call_id, result, exc in results:
            if call_id is not None:
                self._results[call_id] = (result, exc)
        others = []
        for out in outputs:
            shown = self._requests.get(out.request_id)
            if shown is None:
                others.append(out)
            else:
                self._restore(out, shown)
                self._ready.append(out)
        return others

    def _call(self, kind: str, args: tuple) -> Any:
        self._check_open()
        call_id = next(self._call_ids)
        self._core.submit([(call_id, kind, args)])
        while call_id not in self._results:
            self._pump(block=True)
        result, exc = self._results.pop(call_id)
        if exc is not None:
            raise exc
        return result

    def _check_open(self) -> None:
        if self._inbox.failure is not None:
            raise RuntimeError(
                f"the data-parallel engine cannot continue: {self._inbox.failure}; shut it down and create a new one"
            )
        if not self._finalizer.alive:
            raise RuntimeError("the engine was shut down (its data-parallel replicas are gone): create a new one")

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Queue one request on the least-loaded replica and return its id; an invalid request raises
        InvalidRequestError (the replica's) and queues nothing. ``priority``: as ``LLMEngine.add_request``'s."""
        sampling_params = with_priority(sampling_params, priority)
        with self._lock:
            self._check_open()
            if request_id is None:
                request_id = str(next(self._request_counter))
                while request_id in self._requests:
                    request_id = str(next(self._request_counter))
            elif request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            sent, shown = self._prepare(prompt, sampling_params)
            self._requests[request_id] = shown
            try:
                self._call("add", (sent, sampling_params if sampling_params is not None else SamplingParams(),
                                   request_id))  # fmt: skip
            except BaseException:
                del self._requests[request_id]
                raise
            return request_id

    def step(self) -> list[RequestOutput]:
        """The outputs of add_request's requests that arrived since the last call (finished ones, and for
        ``output_kind`` ``"delta"``/``"cumulative"`` the progress). Waits for one while requests are unfinished
        and nothing has arrived."""
        with self._lock:
            self._check_open()
            self._pump(block=False)
            while not self._ready and self._requests:
                self._pump(block=True)
            ready, self._ready = self._ready, []
            for out in ready:
                if out.finished:
                    self._requests.pop(out.request_id, None)
            return ready

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request of add_request's: returns its final output (which step() will not return), or None
        if the id is unknown or its final output was already returned."""
        with self._lock:
            if request_id not in self._requests:
                return None
            self._call("abort", (request_id,))
            while True:  # its final output came with the abort's answer, or before it
                final = next((o for o in self._ready if o.request_id == request_id and o.finished), None)
                if final is not None:
                    break
                self._pump(block=True)
            self._ready.remove(final)
            del self._requests[request_id]
            return final

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        """add_request's requests whose final output step() has not returned yet."""
        return len(self._requests)

    # --- state and life cycle ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Every replica's stats combined (:func:`combine_stats`): queues and counters summed, KV-cache usage over
        all blocks, prefix-cache hit rate over all queries."""
        with self._lock:
            return self._call("stats", ())

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own stats, in replica order."""
        with self._lock:
            return self._call("replica_stats", ())

    @property
    def replica_processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The replicas' processes (replica r at index r)."""
        return [replica.process for replica in self._core.replicas]

    def shutdown(self) -> None:
        """Stop every replica (also done by ``with``, when the LLM is garbage-collected, and at exit). A call that
        waits on the replicas in another thread raises "the engine was shut down"."""
        inbox = self.__dict__.get("_inbox")
        if inbox is not None:
            inbox.fail(RuntimeError("the engine was shut down (its data-parallel replicas are gone): create a new one"))
        finalizer = self.__dict__.get("_finalizer")
        if finalizer is not None:
            finalizer()
