"""The simulated engine: the real :class:`EngineCore`, the installed scheduler and block-manager plugins, and a
step runner that emits tokens without a model; each step's duration comes from a :class:`Calibration`.

Time is simulated, never measured. Requests arrive at their trace times between steps; when nothing runs the
clock jumps to the next arrival. With async scheduling (as on a GPU) step N+1 is scheduled while step N runs:
the host schedules it once step N-1's tokens are read, and it starts on the GPU when step N ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nanovllm_bench.simulate.cost import Calibration
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineCore
from nanovllm_core.engine.input_batch import causal_pairs
from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import ConfigError
from nanovllm_core.interfaces import Scheduler, SchedulerOutput
from nanovllm_core.sampling_params import SamplingParams

EMITTED_TOKEN = 1  # every simulated token; requests ignore EOS and stop at max_tokens, as bench serve's do


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
    token_times: list[float] = field(default_factory=list)


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


class _Step:
    """A launched step: the tokens it samples, when the GPU finishes it, and who receives a token then."""

    __slots__ = ("batch", "sampled", "end", "sim", "receivers")

    def __init__(
        self, batch: SchedulerOutput, sampled: list[int | None], end: float, sim: SimulatedEngine,
        receivers: list[list[float]],
    ) -> None:
        self.batch, self.sampled, self.end, self.sim, self.receivers = batch, sampled, end, sim, receivers

    def tokens(self) -> list[int | None]:
        end = self.end
        for token_times in self.receivers:
            token_times.append(end)
        if end > self.sim.read_until:
            self.sim.read_until = end
        return self.sampled


class _CostRunner:
    """Launches a step on no device: the tokens are fixed, the step's GPU interval comes from the cost model.

    It runs for every sequence of every step, so it is one pass over the batch, no per-token objects."""

    def __init__(self, sim: SimulatedEngine) -> None:
        self.sim = sim

    def launch(self, batch: SchedulerOutput, in_flight: Any | None = None) -> _Step:
        sim = self.sim
        seqs, counts = batch.seqs, batch.num_new_tokens
        query = sum(counts)
        # one pass: the KV tokens after the step, and a token for each sequence whose chunk reaches its last token
        # (decodes, and prompts' last chunks), whose request receives it (none while untimed)
        kv_tokens = query
        sampled: list[int | None] = []
        receivers: list[list[float]] = []
        token_times = sim.token_times
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            kv_tokens += start
            if start + n == len(seq.token_ids):
                sampled.append(EMITTED_TOKEN)
                if token_times is not None:
                    receivers.append(token_times[seq.request_id])
            else:
                sampled.append(None)
        pairs = 0.0
        if query > len(seqs):  # some prompt chunk: its causal attention's query-key pairs
            pairs = causal_pairs(counts, [seq.num_computed_tokens for seq in seqs])
        duration = sim.calibration.step_ms(len(seqs), query, kv_tokens, pairs) / 1e3
        begin = max(sim.now, sim.gpu_free)
        sim.gpu_free = begin + duration
        sim.gpu_busy += duration
        if sim.record_batches:
            sim.batches.append(list(zip([seq.request_id for seq in seqs], counts)))
        return _Step(batch, sampled, sim.gpu_free, sim, receivers)


class SimulatedEngine:
    """Replays a trace through the engine core with the named plugins; ``run`` returns every request's times.

    ``scheduler``: a registered name, ``module:Class`` or a :class:`Scheduler` class (a policy not installed yet)."""

    def __init__(
        self,
        calibration: Calibration,
        *,
        scheduler: str | type[Scheduler] = "fifo",
        scheduler_options: dict[str, Any] | None = None,
        block_manager: str = "prefix_cache",
        block_manager_options: dict[str, Any] | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        max_model_len: int = 8192,
        num_kvcache_blocks: int | None = None,
        kvcache_block_size: int | None = None,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
        record_batches: bool = False,
    ) -> None:
        from nanovllm_core.plugins import get_registry

        self.calibration = calibration
        registry = get_registry()
        if isinstance(scheduler, str) and ":" in scheduler:
            scheduler_cls, name = _import_class(scheduler), scheduler
        elif isinstance(scheduler, str):
            scheduler_cls, name = registry.get("scheduler", scheduler).obj, scheduler
        else:
            scheduler_cls, name = scheduler, scheduler.__name__
        block_manager_cls = registry.get("block_manager", block_manager).obj
        self.config = EngineConfig(
            model="(simulated)",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kvcache_block_size=kvcache_block_size or calibration.kvcache_block_size,
            num_kvcache_blocks=num_kvcache_blocks or calibration.num_kvcache_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        cfg = self.config
        assert cfg.num_kvcache_blocks is not None
        # as LLMEngine builds them: validated options as keyword arguments
        self.block_manager = instantiate(
            "block_manager", block_manager_cls, dict(block_manager_options or {}), cfg.num_kvcache_blocks,
            cfg.kvcache_block_size, enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = instantiate("scheduler", scheduler_cls, dict(scheduler_options or {}), cfg, self.block_manager)
        self.scheduler_name = name
        self.core = EngineCore(
            cfg, self.scheduler, _CostRunner(self), scheduler_name=name, async_scheduling=async_scheduling
        )
        self.record_batches = record_batches
        self.batches: list[list[tuple[str, int]]] = []  # (request id, new tokens) of each launched step
        self.now = 0.0  # the host's clock
        self.gpu_free = 0.0  # when the GPU finishes the last launched step
        self.gpu_busy = 0.0
        self.read_until = 0.0
        self.times: dict[str, RequestTimes] = {}
        # request id -> its RequestTimes.token_times, where a step's tokens land; None while untimed (warm-up)
        self.token_times: dict[str, list[float]] | None = {}
        self.steps = 0
        # (time, KV-cache use, running, waiting, preemptions so far) after each step
        self.timeline: list[tuple[float, float, int, int, int]] = []
        self._params: dict[tuple[int, int], SamplingParams] = {}  # (max_tokens, priority) -> a request's parameters

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
        saved, self.token_times = self.token_times, None
        while self.core.has_unfinished_requests():
            self.core.step()
        self.token_times = saved
        self.now = self.gpu_free = self.gpu_busy = self.read_until = 0.0
        self.batches.clear()
        self.scheduler.num_preemptions = 0

    def run(self, trace: list[TraceRequest], max_steps: int = 10_000_000) -> list[RequestTimes]:
        """Every request of ``trace`` (sorted by arrival) through the engine; their token times."""
        cal = self.calibration
        intake = cal.frontend.get("intake_ms", 0.0) / 1e3
        intake_per_token = cal.frontend.get("intake_ms_per_1k_prompt_tokens", 0.0) / 1e6
        host_gap = cal.host_gap_ms / 1e3
        pending = sorted(trace, key=lambda r: r.arrival)
        for i, req in enumerate(pending):
            if not req.request_id:
                req.request_id = str(i)
        if len({r.request_id for r in pending}) != len(pending):
            raise ConfigError("the trace repeats a request id")
        timed = [RequestTimes(req, admitted=req.arrival + intake + intake_per_token * len(req.prompt))
                 for req in pending]  # fmt: skip
        assert self.token_times is not None
        for t in timed:
            self.times[t.request.request_id] = t
            self.token_times[t.request.request_id] = t.token_times
        core, bm, scheduler = self.core, self.block_manager, self.scheduler
        with _cyclic_gc_paused():
            nxt = 0
            while True:
                if not core.has_unfinished_requests():
                    if nxt == len(timed):
                        break
                    self.now = max(self.now, timed[nxt].admitted)
                while nxt < len(timed) and timed[nxt].admitted <= self.now:
                    self._add(timed[nxt].request)
                    timed[nxt].admitted_step = self.steps
                    nxt += 1
                core.step()
                self.steps += 1
                if self.steps > max_steps:
                    raise RuntimeError(f"{self.scheduler_name}: more than {max_steps} steps (starvation or a livelock)")
                # the host waited for the tokens it read, then spends its per-step time; without async scheduling it
                # waited for this step too
                self.now = max(self.now, self.read_until) + host_gap
                if not core.async_scheduling:
                    self.now = max(self.now, self.gpu_free)
                self.timeline.append(
                    (
                        self.now,
                        1.0 - bm.num_free_blocks / bm.num_blocks,
                        scheduler.num_running,
                        scheduler.num_waiting,
                        scheduler.num_preemptions,
                    )
                )
        return timed
