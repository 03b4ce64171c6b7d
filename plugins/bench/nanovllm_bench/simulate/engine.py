"""A trace replayed through the core's :class:`SimulatedEngine` (the real :class:`EngineCore`, the installed
scheduler and block-manager plugins, a step runner without a model), each step's duration from a :class:`Calibration`.

Time is simulated, never measured. Requests arrive at their trace times between steps; when nothing runs the
clock jumps to the next arrival.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nanovllm_testing.simulated import SimulatedEngine

from nanovllm_bench.simulate.cost import Calibration
from nanovllm_bench.simulate.frontend import FixedFrontEnd, FrontEndQueue, front_end_for
from nanovllm_core.errors import ConfigError
from nanovllm_core.interfaces import Scheduler
from nanovllm_core.sampling_params import SamplingParams


@dataclass
class TraceRequest:
    """One request of a trace: when it is sent (seconds from the start), its prompt and its output length."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: int | None = None
    request_id: str = ""


@dataclass
class RequestTimes:
    """What a client would see of one request, engine-side times: token times in simulated seconds."""

    request: TraceRequest
    admitted: float = 0.0  # reached the engine (arrival + the front-end's intake)
    admitted_step: int = 0  # the step before which it was added
    token_times: list[float] = field(default_factory=list)  # the engine read each token
    delivered: list[float] = field(default_factory=list)  # each token left the front-end for the client


def _import_class(spec: str) -> type[Scheduler]:
    """``module:Class``: a policy that is not installed as a plugin yet (its module importable)."""
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"--scheduler {spec!r}: cannot import it ({exc}); give a registered name or module:Class"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigError(f"--scheduler {spec!r} is not a Scheduler subclass")
    return cls


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The replay allocates many short-lived lists and tuples (every step's batch), which reference counting frees;
    the engine core and the shipped policies leave no garbage cycles while stepping, so the cycle collector's passes
    over them are wasted time (a few percent). A policy that does make cycles holds them until the run ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# the serving engine's defaults, where SimulatedEngine's suit small tests
ENGINE_LIMITS: dict[str, Any] = {
    "max_num_seqs": 256, "max_num_batched_tokens": 16384, "max_model_len": 8192, "async_scheduling": True,
}  # fmt: skip


class TraceSimulator(SimulatedEngine):
    """Replays a trace through the engine core with the named plugins; ``replay`` returns every request's times.

    ``scheduler``: a registered name, ``module:Class`` or a :class:`Scheduler` class (a policy not installed yet).
    The KV cache is the calibration's unless given; ``options`` are :class:`SimulatedEngine`'s (limits, async
    scheduling, prefix caching, plugin options), the limits by default those of :data:`ENGINE_LIMITS`."""

    def __init__(
        self,
        calibration: Calibration,
        *,
        scheduler: str | type[Scheduler] = "fifo",
        block_manager: str = "prefix_cache",
        num_kvcache_blocks: int | None = None,
        kvcache_block_size: int | None = None,
        record_batches: bool = False,
        **options: Any,
    ) -> None:
        from nanovllm_core.plugins import get_registry

        registry = get_registry()
        if isinstance(scheduler, str) and ":" in scheduler:
            scheduler_cls, name = _import_class(scheduler), scheduler
        elif isinstance(scheduler, str):
            scheduler_cls, name = registry.get("scheduler", scheduler).obj, scheduler
        else:
            scheduler_cls, name = scheduler, scheduler.__name__
        super().__init__(
            scheduler_cls,
            registry.get("block_manager", block_manager).obj,
            num_blocks=num_kvcache_blocks or calibration.num_kvcache_blocks,
            block_size=kvcache_block_size or calibration.kvcache_block_size,
            step_cost=calibration,
            checked=False,
            record_steps=record_batches,
            name=name,
            **{**ENGINE_LIMITS, **options},
        )
        self.calibration = calibration
        self.front_end: FixedFrontEnd | None = None  # the last replay's
        self.times: dict[str, RequestTimes] = {}
        # (time, KV-cache use, running, waiting, preemptions so far) after each step
        self.timeline: list[tuple[float, float, int, int, int]] = []
        self._params: dict[tuple[int, int], SamplingParams] = {}  # (max_tokens, priority) -> a request's parameters

    @property
    def batches(self) -> list[list[tuple[str, int]]]:
        """(request id, new tokens) of each launched step, with ``record_batches``."""
        return self.scheduled

    def _add(self, req: TraceRequest) -> None:
        # only the final output, and no text: nothing reads either. Requests of one length and priority share their
        # parameters (the engine reads them, never writes them)
        key = (req.max_tokens, req.priority or 0)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = SamplingParams(
                temperature=0.0, max_tokens=key[0], ignore_eos=True, output_kind="final", detokenize=False,
                priority=key[1],
            )
        self.core.add_request(req.prompt, params, req.request_id)

    def warm_prefix_cache(self, prompts: list[list[int]]) -> None:
        """Prefill ``prompts`` (one output token each, untimed) so that their blocks stay in the prefix cache, as on
        a server that served them before; then start the clock and the counters from zero."""
        for i, prompt in enumerate(prompts):
            self.core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), f"warm-{i}")
        while self.core.has_unfinished_requests():
            self.core.step()
        self.now = self.gpu_free = self.gpu_busy = self.read_until = 0.0
        for record in (self.batch_sizes, self.scheduled, self.preempted):
            record.clear()
        self.scheduler.num_preemptions = 0

    def replay(self, trace: list[TraceRequest], max_steps: int = 10_000_000) -> list[RequestTimes]:
        """Every request of ``trace`` (sorted by arrival) through the front-end and the engine; their token times."""
        front = self.front_end = front_end_for(self.calibration.frontend)
        pending = sorted(trace, key=lambda r: r.arrival)
        for i, req in enumerate(pending):
            if not req.request_id:
                req.request_id = str(i)
        if len({r.request_id for r in pending}) != len(pending):
            raise ConfigError("the trace repeats a request id")
        timed = [RequestTimes(req) for req in pending]
        for t in timed:
            self.times[t.request.request_id] = t
            self.token_times[t.request.request_id] = t.token_times
            front.expect(t.token_times, t.request.max_tokens)
        # requests are admitted in arrival order, each once the engine has stepped past its arrival (or is idle):
        # a queued front-end needs the outputs that came back before it, known only then
        known = 0  # requests whose admission time is computed
        self.on_read = front.on_read if isinstance(front, FrontEndQueue) else None
        core, bm, scheduler = self.core, self.block_manager, self.scheduler
        with _cyclic_gc_paused():
            nxt = 0
            while True:
                idle = not core.has_unfinished_requests()
                if idle and nxt == len(timed):
                    break
                while nxt < len(timed):
                    t = timed[nxt]
                    if nxt == known:
                        if t.request.arrival > self.now and not idle:
                            break
                        t.admitted = front.admit(t.request.arrival, len(t.request.prompt))
                        known += 1
                    if t.admitted > self.now:
                        if not idle:
                            break
                        self.now = t.admitted  # nothing runs: the clock jumps to the next admission
                    self._add(t.request)
                    t.admitted_step = self.steps
                    nxt += 1
                    idle = False
                self.step()
                if self.steps > max_steps:
                    raise RuntimeError(f"{self.name}: more than {max_steps} steps (starvation or a livelock)")
                self.timeline.append(
                    (
                        self.now,
                        1.0 - bm.num_free_blocks / bm.num_blocks,
                        scheduler.num_running,
                        scheduler.num_waiting,
                        scheduler.num_preemptions,
                    )
                )
        self.on_read = None
        for t in timed:
            t.delivered = front.delivered(t.token_times)
        return timed
