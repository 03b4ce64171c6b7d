"""The simulated engine: the real :class:`EngineCore`, the installed scheduler and block-manager plugins, and a
step runner that emits tokens without a model; each step's duration comes from a :class:`Calibration`.

Time is simulated, never measured. Requests arrive at their trace times between steps; when nothing runs the
clock jumps to the next arrival. With async scheduling (as on a GPU) step N+1 is scheduled while step N runs:
the host schedules it once step N-1's tokens are read, and it starts on the GPU when step N ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineCore
from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import ConfigError
from nanovllm_core.interfaces import Scheduler, SchedulerOutput
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.simulate.cost import Calibration

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


class _AnyRequest(dict):
    """Token times of untimed requests: recorded nowhere."""

    def __missing__(self, key: str) -> RequestTimes:
        return RequestTimes(TraceRequest(0.0, [], 0))


class _Step:
    __slots__ = ("batch", "sampled", "end", "sim")

    def __init__(self, batch: SchedulerOutput, sampled: list[int | None], end: float, sim: SimulatedEngine) -> None:
        self.batch, self.sampled, self.end, self.sim = batch, sampled, end, sim

    def tokens(self) -> list[int | None]:
        times, end = self.sim.times, self.end
        for seq, token in zip(self.batch.seqs, self.sampled):
            if token is not None:
                times[seq.request_id].token_times.append(end)
        self.sim.read_until = max(self.sim.read_until, end)
        return self.sampled


class _CostRunner:
    """Launches a step on no device: the tokens are fixed, the step's GPU interval comes from the cost model."""

    def __init__(self, sim: SimulatedEngine) -> None:
        self.sim = sim

    def launch(self, batch: SchedulerOutput, in_flight: Any | None = None) -> _Step:
        sim = self.sim
        seqs_n, query, kv, pairs = len(batch.seqs), 0, 0, 0.0
        sampled: list[int | None] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            query += n
            kv += start + n
            if n > 1:
                pairs += n * (start + (n + 1) / 2)
            sampled.append(EMITTED_TOKEN if start + n == seq.num_tokens else None)
        duration = sim.calibration.step_ms(seqs_n, query, kv, pairs) / 1e3
        begin = max(sim.now, sim.gpu_free)
        sim.gpu_free = begin + duration
        sim.gpu_busy += duration
        if sim.record_batches:
            sim.batches.append([(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        return _Step(batch, sampled, sim.gpu_free, sim)


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
        self.steps = 0
        # (time, KV-cache use, running, waiting, preemptions so far) after each step
        self.timeline: list[tuple[float, float, int, int, int]] = []

    def _add(self, req: TraceRequest) -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True, output_kind="final", priority=req.priority or 0
        )
        self.core.add_request(req.prompt, params, req.request_id)

    def warm_prefix_cache(self, prompts: list[list[int]]) -> None:
        """Prefill ``prompts`` (one output token each, untimed) so that their blocks stay in the prefix cache, as on
        a server that served them before; then start the clock and the counters from zero."""
        for i, prompt in enumerate(prompts):
            self.core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), f"warm-{i}")
        saved, self.times = self.times, _AnyRequest()
        while self.core.has_unfinished_requests():
            self.core.step()
        self.times = saved
        self.now = self.gpu_free = self.gpu_busy = self.read_until = 0.0
        self.batches.clear()
        self.scheduler.num_preemptions = 0

    def run(self, trace: list[TraceRequest], max_steps: int = 10_000_000) -> list[RequestTimes]:
        """Every request of ``trace`` (sorted by arrival) through the engine; their token times."""
        cal = self.calibration
        intake = cal.frontend.get("intake_ms", 0.0) / 1e3
        host_gap = cal.host_gap_ms / 1e3
        pending = sorted(trace, key=lambda r: r.arrival)
        for i, req in enumerate(pending):
            if not req.request_id:
                req.request_id = str(i)
        if len({r.request_id for r in pending}) != len(pending):
            raise ConfigError("the trace repeats a request id")
        for req in pending:
            self.times[req.request_id] = RequestTimes(req, admitted=req.arrival + intake)
        core, bm, scheduler = self.core, self.block_manager, self.scheduler
        nxt = 0
        while nxt < len(pending) or core.has_unfinished_requests():
            if not core.has_unfinished_requests():
                self.now = max(self.now, self.times[pending[nxt].request_id].admitted)
            while nxt < len(pending) and self.times[pending[nxt].request_id].admitted <= self.now:
                self._add(pending[nxt])
                self.times[pending[nxt].request_id].admitted_step = self.steps
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
        return [self.times[r.request_id] for r in pending]
