"""``GET /metrics``: the server's Prometheus metrics (text format, vLLM's names under ``nanovllm:``, and the
series vLLM has a counterpart of also under vLLM's own names, ``vllm:...``, so that a vLLM dashboard works unchanged).

Engine state (running / waiting requests, KV-cache usage, prefix-cache hits, token and preemption counters)
is read from the engine core's ``stats()`` at scrape time, with the step loop's own account (steps, time inside
``step()``, the loop thread's CPU time) and the process's CPU time; request latencies (time to first token, inter-token
latency, end to end) are observed by the async front-end as outputs arrive, the stages of each finished request
(queue, prefill, decode, inference; the front-end's part and the hand-overs to and from the engine) from its
timeline (``serving/timeline.py``), and finished
requests are counted by finish reason. Two stall detectors: the engine steps over 50 ms / 200 ms / 1 s (and the
longest), and the front-end event loop's lag.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from nanovllm_core.engine_client.base import SLOW_STEP_SECONDS
from nanovllm_core.serving.timeline import RequestTimeline, RequestTimelineLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# Series exposed a second time under vLLM's name (``vllm:`` + the name), with the same value and labels: those
# whose meaning is vLLM's. vLLM's time_per_output_token_seconds is its older name of the inter-token latency.
VLLM_SERIES = frozenset({"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                         "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens"})  # fmt: skip
VLLM_HISTOGRAMS = {name: (name,) for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_inference_time_seconds")}  # fmt: skip
VLLM_HISTOGRAMS["inter_token_latency_seconds"] += ("time_per_output_token_seconds",)


class EngineStatsCollector(Collector):
    """Yields the engine's gauges and counters from the last ``stats()`` snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Any = None
        self.loop: Any = None  # the AsyncLLM, for its step loop's own account

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        label = [self.model_name]
        gauges = [
            ("num_requests_running", "Requests with sequences in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", s.kv_cache_usage),
            ("num_kv_blocks", "KV-cache blocks in total.", s.num_kv_blocks),
            ("num_free_kv_blocks", "KV-cache blocks free.", s.num_free_kv_blocks),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.", s.prefix_cache_hit_rate),
        ]
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted (their KV is recomputed later).", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed.", s.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens),
            (
                "cuda_graph_steps",
                "Engine steps replayed from CUDA graphs (decode steps, and steps with prompt tokens up to "
                "cuda_graph_max_mixed_tokens); the other steps ran eagerly.",
                s.num_cuda_graph_steps,
            ),
        ]
        account = self.loop.account if self.loop is not None else None
        if account is not None:
            counters += [
                ("step_loop_steps", "Engine steps run by the step loop.", account.steps),
                ("step_loop_busy_seconds", "Wall time the step loop spent inside engine.step().", account.step_seconds),
                ("step_loop_cpu_seconds", "CPU time of the step-loop thread.", account.cpu_seconds),
                (
                    "step_loop_emit_seconds",
                    "Wall time the step loop spent handing outputs to the front-end (an engine process: pickling, "
                    "and waiting on a full pipe).",
                    account.emit_seconds,
                ),
            ]
        for family, series in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in series:
                for prefix in ("nanovllm", "vllm") if name in VLLM_SERIES else ("nanovllm",):
                    metric = family(f"{prefix}:{name}", doc, labels=["model_name"])
                    metric.add_metric(label, value)
                    yield metric
        if account is not None:
            metric = CounterMetricFamily(
                "nanovllm:step_loop_slow_steps",
                "Engine steps that took longer than `over` seconds.",
                labels=["model_name", "over"],
            )
            for limit, count in zip(SLOW_STEP_SECONDS, account.slow_steps):
                metric.add_metric([*label, f"{limit:g}"], count)
            yield metric
            metric = GaugeMetricFamily(
                "nanovllm:step_loop_longest_step_seconds", "The longest engine step so far.", labels=["model_name"]
            )
            metric.add_metric(label, account.longest_step_seconds)
            yield metric


class LatencyHistogram:
    """A Prometheus histogram observed on the front-end's event loop: a bisect and two additions per observation,
    no lock. The front-end observes every streamed token's inter-token latency, so this runs once per token:
    several times cheaper than ``prometheus_client``'s ``Histogram.observe`` (a lock, a scan of the buckets, locked
    increments) (``benchmarks/frontend_capacity.py`` measures the front-end's CPU per token).
    Exposed as the same ``_bucket``/``_count``/``_sum`` series by :class:`HistogramCollector`. Not thread-safe:
    observe from one thread (the event loop)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], aliases: tuple[str, ...] = ()) -> None:
        self.name, self.doc = name, doc
        self.aliases = aliases  # more names the same series is exposed under (vLLM's)
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le semantics: value <= bound
        self.sum += value

    def family(self, model_name: str, name: str | None = None) -> HistogramMetricFamily:
        """The series under its name, or under ``name`` (one of its aliases)."""
        cumulative, total = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        family = HistogramMetricFamily(name or self.name, self.doc, labels=["model_name"])
        family.add_metric([model_name], cumulative, sum_value=self.sum)
        return family


class HistogramCollector(Collector):
    def __init__(self, model_name: str, histograms: list[LatencyHistogram]) -> None:
        self.model_name, self.histograms = model_name, histograms

    def collect(self) -> Iterator[Metric]:
        for histogram in self.histograms:
            yield histogram.family(self.model_name)
            for alias in histogram.aliases:
                yield histogram.family(self.model_name, alias)


class ServerMetrics:
    """One registry per server (so several servers in one process, as in tests, do not collide)."""

    def __init__(self, model_name: str, timeline_log: RequestTimelineLog | None = None) -> None:
        self.timeline_log = timeline_log  # --request-timeline: each finished request's stamps, a JSON line
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total and friends (Linux)

        histograms: list[LatencyHistogram] = []  # exposed in the order they are made

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LatencyHistogram:
            aliases = tuple(f"vllm:{alias}" for alias in VLLM_HISTOGRAMS.get(name, ()))
            histograms.append(LatencyHistogram(f"nanovllm:{name}", doc, buckets, aliases))
            return histograms[-1]

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output.", E2E_BUCKETS)
        self.loop_lag = histogram(
            "frontend_event_loop_lag_seconds",
            "How late the front-end's event loop ran a timer due every 10 ms: its stalls (long callbacks, garbage "
            "collection), which every stream waits on.",
            LAG_BUCKETS,
        )
        # vLLM's request stages, from the engine's timestamps (RequestMetrics, with each finished request)
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time a request waited in the engine's queue: from its arrival in the engine to its first scheduling.",
            TTFT_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "Time from a request's first scheduling to its first token.", TTFT_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "Time from a request's first token to its last.", E2E_BUCKETS
        )
        self.inference = histogram(
            "request_inference_time_seconds", "Time from a request's first scheduling to its end.", E2E_BUCKETS
        )
        # the front-end's own part before the engine: the HTTP body, its validation, the prompt's tokenization
        self.frontend = histogram(
            "request_frontend_time_seconds",
            "Time from the server's receipt of a request (the start of its HTTP request) to its hand-over to the "
            "engine: reading and validating the body, the chat template, tokenizing the prompt.",
            TTFT_BUCKETS,
        )
        # and the two hand-overs between the front-end and the engine, which the engine's timestamps leave out
        self.intake = histogram(
            "request_intake_time_seconds",
            "Time from the front-end's arrival of a request to its arrival in the engine (the command pipe, and "
            "the wait for the running step to end).",
            LAG_BUCKETS,
        )
        self.delivery = histogram(
            "output_delivery_lag_seconds",
            "Time from the engine handing a step's outputs over to the front-end acting on them (the output pipe, "
            "and the front-end's event loop), one observation per step.",
            LAG_BUCKETS,
        )
        self.registry.register(HistogramCollector(model_name, histograms))
        self.finished_requests = [
            Counter(
                f"{prefix}:request_success",
                "Finished requests by finish reason (stop, length, abort).",
                ["model_name", "finished_reason"],
                registry=self.registry,
            )
            for prefix in ("nanovllm", "vllm")
        ]
        self.model_name = model_name

    # OutputObserver
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, seconds: float, finish_reason: str | None) -> None:
        self.e2e.observe(seconds)
        for counter in self.finished_requests:
            counter.labels(self.model_name, finish_reason or "unknown").inc()

    def timeline(self, timeline: RequestTimeline) -> None:
        t = timeline
        self.frontend.observe(max(0.0, t.handed - t.received))
        self.intake.observe(max(0.0, t.engine_arrival - t.handed))
        if t.first_scheduled is not None:
            self.queue.observe(t.first_scheduled - t.engine_arrival)
            if t.first_token is not None:
                self.prefill.observe(t.first_token - t.first_scheduled)
            if t.finished is not None:
                self.inference.observe(t.finished - t.first_scheduled)
        if t.first_token is not None and t.finished is not None:
            self.decode.observe(t.finished - t.first_token)
        if self.timeline_log is not None:
            self.timeline_log.write(t)

    def delivery_lag(self, seconds: float) -> None:
        self.delivery.observe(max(0.0, seconds))

    async def watch_event_loop(self, period: float = 0.01) -> None:
        """Observe the event loop's lag until cancelled: sleep ``period``, record how late the wake-up came."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def render(self, stats: Any, loop: Any = None) -> bytes:
        """The text exposition with the engine's ``stats`` snapshot and the step loop (an AsyncLLM)'s counters."""
        self.engine.stats, self.engine.loop = stats, loop
        return generate_latest(self.registry)
