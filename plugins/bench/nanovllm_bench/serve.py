"""``nanovllm bench serve``: load a running server through ``/v1/completions`` and report vLLM's serving metrics.

Metrics (as vLLM's ``benchmark_serving``): request throughput, output and total token throughput, and the
mean / median / p90 / p99 of TTFT (time to first token), TPOT (time per output token after the first),
ITL (time between two streamed chunks) and end-to-end latency, in milliseconds.

Workloads (token-id prompts, ``ignore_eos`` so every request produces exactly its drawn length):
- ``nano``: nano-vllm's benchmark: ``--num-prompts`` (256) requests, ``random.seed(0)``, prompts of
  ``randint(100, 1024)`` token ids ``randint(0, 10000)``, outputs of ``randint(100, 1024)`` tokens,
  temperature 0.6 (the offline ``nanovllm bench`` workload, request for request).
- ``sharegpt-synth``: a synthetic ShareGPT-like length mix: prompt lengths LogNormal(ln 120, 1.1) and output
  lengths LogNormal(ln 140, 0.8), rounded and clipped to [4, 1024] (means about 220 and 190 tokens, a long
  tail, like the ShareGPT V3 conversations vLLM samples); token ids uniform in ``[0, --vocab-size)``.
- ``random``: vLLM's random dataset: prompt and output lengths uniform in ``[len * (1 - r), len * (1 + r)]`` for
  ``--random-input-len``, ``--random-output-len`` and ``--random-range-ratio`` ``r`` (1024, 128, 0: fixed
  lengths), token ids uniform in ``[0, --vocab-size)``. Long prompts are where prefill scheduling shows.

Arrivals are a Poisson process at ``--request-rate`` requests/s (``inf``: all at once); ``--rates 1,2,inf``
runs the workload once per rate for a latency-vs-rate curve (``benchmarks/plot.py`` draws it).

Before the run it reads the server's ``max_model_len`` (``/v1/models``) and checks that its model takes the
workload's largest token id, so that the defaults fit a small model (the demo's 384 ids and 1,024 tokens): ids it does
not take are wrapped into its vocabulary (not with an explicit ``--vocab-size``), and requests longer than
``max_model_len`` are scaled down to fit, each with a one-line notice. The client is aiohttp's, as in ``vllm bench
serve``, whose option names it accepts beside its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanovllm_core.errors import ConfigError
from nanovllm_core.gc_heap import GCPauses, freeze_startup_heap

SYNTH_PROMPT = (math.log(120), 1.1)
SYNTH_OUTPUT = (math.log(140), 0.8)
SYNTH_RANGE = (4, 1024)


@dataclass
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    priority: int | None = None  # sent as vLLM's extra field ``priority`` (lower is more urgent)
    arrival: float | None = None  # seconds from the start, from a trace that gives them


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    priority: int | None = None


def nano_workload(num_prompts: int, max_input_len: int, max_output_len: int) -> list[BenchRequest]:
    from nanovllm_bench.offline import workload

    prompts, max_tokens = workload(num_prompts, max_input_len, max_output_len)
    return [BenchRequest(p, m) for p, m in zip(prompts, max_tokens)]


def draw_requests(
    num_prompts: int, vocab_size: int, rng: random.Random, lengths: Callable[[], tuple[int, int]]
) -> list[BenchRequest]:
    """``num_prompts`` requests of ``lengths()`` (prompt, output) each, token ids uniform in ``[0, vocab_size)``."""
    requests = []
    for _ in range(num_prompts):
        prompt_len, output_len = lengths()
        requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len))
    return requests


def synthetic_sharegpt(num_prompts: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    low, high = SYNTH_RANGE

    def draw(mu_sigma: tuple[float, float]) -> int:
        return min(high, max(low, round(rng.lognormvariate(*mu_sigma))))

    return draw_requests(num_prompts, vocab_size, rng, lambda: (draw(SYNTH_PROMPT), draw(SYNTH_OUTPUT)))


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[BenchRequest]:
    if input_len < 1 or output_len < 1:
        raise ConfigError(f"--random-input-len {input_len} / --random-output-len {output_len}: at least 1 each")
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--random-range-ratio {range_ratio}: from 0 (fixed lengths) up to, not including, 1")
    rng = random.Random(seed)

    def draw(length: int) -> int:
        return max(1, rng.randint(round(length * (1 - range_ratio)), round(length * (1 + range_ratio))))

    return draw_requests(num_prompts, vocab_size, rng, lambda: (draw(input_len), draw(output_len)))


DATASETS = ("nano", "sharegpt-synth", "random")


def read_trace(path: str, seed: int, vocab_size: int) -> list[BenchRequest]:
    """A JSONL trace: one request a line, ``{"arrival": s, "prompt": [ids] | "prompt_len": n, "max_tokens": n,
    "priority": p}`` (``arrival`` and ``priority`` optional; ``arrival`` on every line or on none). A
    ``prompt_len`` prompt is token ids uniform in ``[0, vocab_size)``, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--dataset {path}: cannot read the trace ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: a JSON object per line, not {type(row).__name__}")
        if "prompt" in row:
            prompt = row["prompt"]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
                raise ConfigError(f"{where}: 'prompt' is a non-empty list of token ids")
        elif isinstance(row.get("prompt_len"), int) and row["prompt_len"] >= 1:
            prompt = [rng.randrange(vocab_size) for _ in range(row["prompt_len"])]
        else:
            raise ConfigError(f"{where}: give 'prompt' (token ids) or 'prompt_len' (an integer >= 1)")
        max_tokens = row.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"{where}: 'max_tokens' is an integer >= 1, not {max_tokens!r}")
        arrival = row.get("arrival")
        if arrival is not None and (not isinstance(arrival, (int, float)) or arrival < 0):
            raise ConfigError(f"{where}: 'arrival' is seconds from the start (>= 0), not {arrival!r}")
        priority = row.get("priority")
        if priority is not None and not isinstance(priority, int):
            raise ConfigError(f"{where}: 'priority' is an integer, not {priority!r}")
        requests.append(BenchRequest(prompt, max_tokens, priority, None if arrival is None else float(arrival)))
    if not requests:
        raise ConfigError(f"--dataset {path}: the trace holds no request")
    timed = [r.arrival is not None for r in requests]
    if any(timed) and not all(timed):
        raise ConfigError(f"--dataset {path}: give 'arrival' on every line or on none (then --request-rate sets them)")
    return requests


def check_dataset(name: str) -> None:
    if name not in DATASETS and not name.endswith(".jsonl"):
        raise ConfigError(f"--dataset {name!r}: one of {', '.join(DATASETS)} or a trace file ending in .jsonl")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


Percentiles = tuple[list[str], list[float]]  # metrics and percentiles that get ``p{Q}_{METRIC}_ms`` keys


def summarize(results: list[RequestResult], duration: float, extra: Percentiles | None = None) -> dict[str, Any]:
    """vLLM's metrics over ``results``; with several priority classes, each class's under ``by_priority``;
    ``extra`` percentiles of some metrics beside the median, p90 and p99 every metric has."""
    summary = _summarize(results, duration, extra)
    classes = sorted({r.priority for r in results if r.priority is not None})
    if len(classes) > 1:
        summary["by_priority"] = {
            str(p): _summarize([r for r in results if r.priority == p], duration, extra) for p in classes
        }
    return summary


def _summarize(results: list[RequestResult], duration: float, extra: Percentiles | None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        # ITL is measured per streamed chunk; a server that falls behind merges several tokens into one chunk
        "mean_tokens_per_chunk": output_tokens / max(1, sum(1 + len(r.itl) for r in done)),
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        summary[f"median_{name}_ms"] = percentile(ms, 50)
        summary[f"p90_{name}_ms"] = percentile(ms, 90)
        summary[f"p99_{name}_ms"] = percentile(ms, 99)
        if extra and name in extra[0]:
            for q in extra[1]:
                summary.setdefault(percentile_key(q, name), percentile(ms, q))
    return summary


AIOHTTP_TIMEOUT_S = 6 * 60 * 60  # vLLM's: one request may stream for hours at a low rate


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError:
        raise ConfigError(
            "nanovllm bench serve needs aiohttp (a dependency of nanovllm-bench): pip install aiohttp"
        ) from None
    return aiohttp


KEEPALIVE_S = 4  # below the server's keep-alive (uvicorn's 5 s, ours and vLLM's): see client_session


def client_session(limit: int = 0) -> Any:
    """An aiohttp session for the load: ``limit`` connections at most (0: no cap, the caller's semaphore caps);
    kept-alive connections are reused, but none idle for longer than ``KEEPALIVE_S``, so that a request is never
    written to a connection the server is closing at that moment (a reset, counted as a failed request). No proxy
    from the environment: the timings are the server's, not a proxy's."""
    aiohttp = _aiohttp()
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S))


class SSEDecoder:
    """Server-sent events from a byte stream cut anywhere (inside a line, between ``\\r`` and ``\\n``): the data of
    each event once its blank line has arrived. Comments and fields other than ``data`` are skipped."""

    def __init__(self) -> None:
        self._rest = b""
        self._data: list[bytes] = []

    def feed(self, raw: bytes) -> list[bytes]:
        buffer = self._rest + raw
        held_cr = buffer.endswith(b"\r")  # maybe the first half of \r\n: decided by the next bytes
        if held_cr:
            buffer = buffer[:-1]
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._rest = lines.pop() + (b"\r" if held_cr else b"")
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events


async def send(session: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    """One streamed completion; times each read of the stream as it arrives (its events arrived together)."""
    result = RequestResult(prompt_tokens=len(body["prompt"]), priority=body.get("priority"))
    decoder = SSEDecoder()
    start = last = time.perf_counter()
    try:
        async with session.post(url, data=json.dumps(body), headers=headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for raw in response.content.iter_any():
                now = time.perf_counter()
                for data in decoder.feed(raw):
                    if data == b"[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    if not chunk["choices"]:
                        continue
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream ended without a usage chunk"
    except Exception as exc:  # noqa: BLE001 - reported per request
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def request_headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def request_body(req: BenchRequest, model: str | None, temperature: float) -> dict[str, Any]:
    return {
        **({"model": model} if model else {}),
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"priority": req.priority} if req.priority is not None else {}),
    }


async def warm_up(
    url: str, headers: dict[str, str], requests: list[BenchRequest], count: int, model: str | None, temperature: float
) -> None:
    """The first ``count`` prompts with every token id shifted by one (no prefix-cache hit on the timed run; ids
    stay below the workload's largest), up to 8 tokens each (no more than the request's own: it fits the model)."""
    bound = max(max(r.prompt) for r in requests) + 1
    shifted = [BenchRequest([(t + 1) % bound for t in r.prompt], min(8, r.max_tokens)) for r in requests[:count]]
    async with client_session() as session:
        bodies = [request_body(r, model, temperature) for r in shifted]
        warm = await asyncio.gather(*(send(session, url, body, headers) for body in bodies))
    if not all(r.ok for r in warm):
        raise ConfigError(f"warm-up request failed: {next(r.error for r in warm if not r.ok)}")


LAG_INTERVAL = 0.01  # seconds between the client's event-loop lag samples


async def watch_loop_lag(samples: list[float], interval: float = LAG_INTERVAL) -> None:
    """Until cancelled, how late this event loop runs a timer due every ``interval`` seconds (appended to
    ``samples``). A busy client reads every stream late, and that lateness counts in the TTFT and ITL it
    reports as if the server had taken it."""
    while True:  # (time.monotonic, not loop.time: uvloop's clock counts whole milliseconds)
        due = time.monotonic() + interval
        await asyncio.sleep(interval)
        samples.append(max(0.0, time.monotonic() - due))


@dataclass
class ClientShare:
    """What one client process measured: its requests' results, its first arrival and last completion
    (``time.monotonic()``, one clock for every process of the machine), its event loop's lag samples, and its
    longest garbage collection during the run (seconds): a collection stops the event loop, and every stream it
    reads meanwhile looks that much slower."""

    results: list[RequestResult]
    start: float
    end: float
    loop_lags: list[float]
    longest_gc_pause: float = 0.0
    send_lateness: list[float] = field(default_factory=list)  # each request sent this long after it was due


async def send_share(
    url: str,
    headers: dict[str, str],
    bodies: list[dict[str, Any]],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    arrivals: list[float] | None = None,
    start_at: float | None = None,
) -> ClientShare:
    """Send ``bodies`` in order, Poisson arrivals at ``request_rate`` (the first at once, or at ``start_at``), or
    each at its ``arrivals`` time (seconds from the start)."""
    lags: list[float] = []
    watcher = asyncio.ensure_future(watch_loop_lag(lags))
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    with GCPauses() as pauses:
        async with client_session() as session:

            async def one(body: dict[str, Any]) -> RequestResult:
                async with gate or contextlib.nullcontext():
                    return await send(session, url, body, headers)

            tasks = []
            late: list[float] = []
            start = time.monotonic()
            due = 0.0
            for i, body in enumerate(bodies):
                # each send is due at its time from the start, so a busy event loop delays a request without
                # delaying every request after it (the arrivals stay the Poisson process the rate names)
                if arrivals is not None:
                    due = arrivals[i]
                elif i and math.isfinite(request_rate):
                    due += rng.expovariate(request_rate)
                await asyncio.sleep(max(0.0, start + due - time.monotonic()))
                late.append(max(0.0, time.monotonic() - start - due))
                tasks.append(asyncio.ensure_future(one(body)))
            results = list(await asyncio.gather(*tasks))
            end = time.monotonic()
    watcher.cancel()
    return ClientShare(results, start, end, lags, pauses.longest_s, late)


def combined_summary(
    shares: list[ClientShare], order: list[list[int]], extra: Percentiles | None = None
) -> dict[str, Any]:
    """vLLM's metrics over every share's results (request ``order[k][j]`` is share ``k``'s ``j``-th), the client
    event loops' lag (mean, p99 and largest, in ms) and their longest garbage collection."""
    results: list[RequestResult | None] = [None] * sum(len(o) for o in order)
    for share, indices in zip(shares, order):
        for index, result in zip(indices, share.results):
            results[index] = result
    duration = max(s.end for s in shares) - min(s.start for s in shares)
    summary = summarize([r for r in results if r is not None], duration, extra)
    lags = [1000 * lag for s in shares for lag in s.loop_lags]
    summary["client_processes"] = len(shares)
    summary["mean_client_loop_lag_ms"] = statistics.fmean(lags) if lags else 0.0
    summary["p99_client_loop_lag_ms"] = percentile(lags, 99)
    summary["max_client_loop_lag_ms"] = max(lags, default=0.0)
    summary["max_client_gc_pause_ms"] = 1000 * max(s.longest_gc_pause for s in shares)
    late = [1000 * x for s in shares for x in s.send_lateness]
    summary["mean_send_lateness_ms"] = statistics.fmean(late) if late else 0.0
    summary["max_send_lateness_ms"] = max(late, default=0.0)
    return summary


def event_loop_runner() -> Callable[[Any], Any]:
    """``uvloop.run`` where uvloop is installed (less client CPU per chunk, as the server), else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def _client_process(connection: Any, job: tuple) -> None:
    """A client process: say it is ready, wait for the common start time, send its share, return what it
    measured (or the exception that ended it)."""
    try:
        # a forked client holds its parent's heap (torch's modules, every request of the workload): out of the
        # collector's way, a full collection during the run walks the run's own objects only
        freeze_startup_heap()
        connection.send("ready")
        start_at = connection.recv()
        connection.send(event_loop_runner()(send_share(*job, start_at=start_at)))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        connection.send(exc)
    finally:
        connection.close()


def _process_context() -> Any:
    """fork where it is safe (Linux, a process with one thread: ``nanovllm bench serve``'s own), else spawn."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def run_workload(
    base_url: str,
    model: str | None,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    temperature: float,
    api_key: str | None,
    warmup: int = 0,
    processes: int = 1,
    endpoint: str = "/v1/completions",
    extra: Percentiles | None = None,
) -> dict[str, Any]:
    """The warm-up (``warmup`` requests), then the workload, and its summary.

    With ``processes`` above 1, from that many client processes, each an event loop of its own: request ``i`` goes
    to process ``i % processes``, whose arrivals are Poisson at ``request_rate / processes`` (together, Poisson at
    ``request_rate``), and each process may have its share of ``max_concurrency`` in flight. All start at one
    moment. Requests that carry their ``arrival`` (a timed trace) are sent at those times instead."""
    if max_concurrency and max_concurrency < processes:
        raise ConfigError(
            f"--max-concurrency {max_concurrency} with --client-processes {processes}: each process needs at "
            "least one request in flight (use at most as many processes as --max-concurrency)"
        )
    url = base_url.rstrip("/") + endpoint
    headers = request_headers(api_key)
    if warmup:
        event_loop_runner()(warm_up(url, headers, requests, warmup, model, temperature))
    order = [list(range(k, len(requests), processes)) for k in range(min(processes, len(requests)))]
    jobs = []
    for k, indices in enumerate(order):  # a process's share of max_concurrency (0 or None: no cap)
        limit = max_concurrency // processes + (k < max_concurrency % processes) if max_concurrency else None
        bodies = [request_body(requests[i], model, temperature) for i in indices]
        arrivals = [requests[i].arrival for i in indices] if requests[0].arrival is not None else None
        jobs.append((url, headers, bodies, request_rate / processes, limit, seed + k, arrivals))
    shares = [event_loop_runner()(send_share(*jobs[0]))] if len(jobs) == 1 else send_shares_in_processes(jobs)
    summary = combined_summary(shares, order, extra)
    summary.update(request_rate=request_rate, max_concurrency=max_concurrency, num_prompts=len(requests))
    return summary


def send_shares_in_processes(jobs: list[tuple]) -> list[ClientShare]:
    """Each job's :func:`send_share` in a client process of its own, all started at one moment once every process
    is ready; their results in the jobs' order. No process outlives the call."""
    context = _process_context()
    children = []
    for job in jobs:
        parent_end, child_end = context.Pipe()
        child = context.Process(target=_client_process, args=(child_end, job), daemon=True)
        child.start()
        child_end.close()
        children.append((child, parent_end))
    try:
        for child, connection in children:
            if connection.recv() != "ready":
                raise RuntimeError(f"client process {child.pid} did not start")
        start_at = time.monotonic() + 0.05  # every process is ready: one start for all
        for _, connection in children:
            connection.send(start_at)
        shares = []
        for _, connection in children:
            share = connection.recv()
            if isinstance(share, BaseException):
                raise share
            shares.append(share)
        return shares
    except EOFError:
        raise RuntimeError("a client process of bench serve ended without its results") from None
    finally:
        for child, connection in children:
            connection.close()
            child.join(timeout=5)
            if child.is_alive():
                child.kill()


DEFAULT_VOCAB_SIZE = 10000  # token ids of the synthetic workloads below this (nano-vllm's ids: up to 10,000)
METRICS = ("ttft", "tpot", "itl", "e2el")


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``nanovllm bench serve``: vLLM's ``vllm bench serve`` names, and ours beside them."""
    parser.add_argument(
        "--base-url", help="the server, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT, vLLM's flags)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="the server's address without --base-url (default %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="the server's port without --base-url (default %(default)s)"
    )
    parser.add_argument(
        "--endpoint", default="/v1/completions", help="the completions path under the base URL (default %(default)s)"
    )
    parser.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    parser.add_argument("--served-model-name", dest="served_model", help="model name to send instead of --model")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        default="nano",
        help=f'{", ".join(DATASETS)}, or a trace FILE.jsonl: one request a line, {{"prompt": [ids] or '
        '"prompt_len": n, "max_tokens": n, "priority": p, "arrival": s} (priority and arrival optional; '
        "with arrivals on every line they are the send times) - the trace format of nanovllm simulate (default: "
        "%(default)s)",
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    parser.add_argument("--rates", help="comma-separated request rates, one run each (e.g. 2,4,8,inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--max-input-len", type=int, default=1024, help="nano workload: longest prompt")
    parser.add_argument("--max-output-len", type=int, default=1024, help="nano workload: longest output")
    parser.add_argument("--random-input-len", type=int, default=1024, help="random: mean prompt length")
    parser.add_argument("--random-output-len", type=int, default=128, help="random: mean output length")
    parser.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random: lengths vary by up to this fraction (0-1)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"sharegpt-synth, random: token ids are below this (default {DEFAULT_VOCAB_SIZE}; without it, and for "
        "nano, ids the server's model does not take are wrapped into its vocabulary)",
    )
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="accepted for vLLM's command lines: every request here ignores EOS, so that it produces its drawn length",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths and the arrivals")
    parser.add_argument("--warmup", type=int, default=32, help="warm-up requests before timing (0: none)")
    parser.add_argument("--result-file", help="write the results as JSON here")
    parser.add_argument(
        "--save-result",
        action="store_true",
        help="write the results as JSON to --result-dir/--result-filename (vLLM's flags; default name "
        "nanovllm-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json)",
    )
    parser.add_argument("--result-dir", help="folder of the --save-result file (default: the current one)")
    parser.add_argument("--result-filename", help="name of the --save-result file")
    parser.add_argument(
        "--percentile-metrics",
        default=",".join(METRICS),
        help="comma-separated metrics whose percentiles are printed (and, with --metric-percentiles, written as "
        "p{Q}_{METRIC}_ms): ttft, tpot, itl, e2el (default: all)",
    )
    parser.add_argument(
        "--metric-percentiles",
        default=None,
        help="comma-separated percentiles to print and write, e.g. 25,50,99.9 (default: 50,90,99; the JSON always "
        "has median, p90 and p99)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send the requests from this many processes, each an event loop of its own (request i from process "
        "i mod N, arrivals still Poisson at the request rate in all): one Python client reading a few hundred "
        "streams can be busy enough to add its own delay to the TTFT and ITL it reports (the summary gives its "
        "event loops' lag)",
    )
    parser.add_argument(
        "--priorities",
        help="comma-separated priority classes given to the requests in turn (e.g. 0,1: every other request is "
        "urgent); the summary then reports each class too",
    )
    parser.add_argument(
        "--server-metrics",
        action="store_true",
        help="after each run, read the server's /metrics and keep its totals in the run's results "
        "(server_metrics: each sample name's value summed over its labels; a run's share is the difference from "
        "the run before it), e.g. the front-end's CPU seconds per request rate",
    )


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates {text!r}: comma-separated numbers or inf, e.g. 2,4,8,inf") from None
    if not rates or any(not r > 0 for r in rates):
        raise ConfigError(f"--rates {text!r}: every rate must be > 0 (inf: all at once)")
    return rates


def parse_percentiles(metrics_text: str, percentiles_text: str | None) -> tuple[list[str], list[float] | None]:
    """``--percentile-metrics`` and ``--metric-percentiles``: the metrics, and the percentiles (None: not given)."""
    metrics = [m.strip() for m in metrics_text.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if not metrics or unknown:
        raise ConfigError(f"--percentile-metrics {metrics_text!r}: comma-separated names out of {', '.join(METRICS)}")
    if percentiles_text is None:
        return metrics, None
    try:
        percentiles = [float(q) for q in percentiles_text.split(",") if q.strip()]
    except ValueError:
        percentiles = []
    if not percentiles or any(not 0 < q <= 100 for q in percentiles):
        raise ConfigError(
            f"--metric-percentiles {percentiles_text!r}: comma-separated numbers above 0 up to 100, e.g. 50,90,99.9"
        )
    return metrics, percentiles


def percentile_key(q: float, metric: str) -> str:
    """vLLM's key of a percentile: ``p99_ttft_ms``, ``p99.9_itl_ms``."""
    return f"p{int(q) if q == int(q) else q}_{metric}_ms"


@dataclass
class ServerInfo:
    """What ``bench serve`` learns from the server before the run: the model names of ``/v1/models``, its
    ``max_model_len``, and the number of token ids its model accepts when that is below the workload's largest id
    (None: the largest id is accepted, or the server does not say)."""

    model_ids: list[str]
    max_model_len: int | None
    vocab_size: int | None = None


async def fetch(request: Any, where: str, url: str, **kwargs: Any) -> tuple[int, str]:
    """``request(url, **kwargs)`` (a session's ``get`` or ``post``): the status and text of the answer; a ConfigError
    naming ``where`` when the server cannot be reached."""
    aiohttp = _aiohttp()
    try:
        async with request(url, **kwargs) as response:
            return response.status, await response.text(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ConfigError(f"cannot reach the server at {where}: {type(exc).__name__}: {exc}") from None


async def read_server_metrics(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """The server's ``/metrics`` as :func:`metric_totals`."""
    async with client_session() as session:
        status, text = await fetch(session.get, base_url, f"{base_url}/metrics", headers=headers)
    if status != 200:
        raise ConfigError(f"{base_url}/metrics answered {status}: --server-metrics needs a nanovllm (or vLLM) server")
    return metric_totals(text)


def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text as totals: each sample's value summed over its labels (histogram buckets and ``_created``
    timestamps left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith(("_bucket", "_created")):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def read_models(session: Any, base_url: str, headers: dict[str, str]) -> ServerInfo:
    """``GET /v1/models``: the names and ``max_model_len`` (vLLM's card field; the smallest of several cards)."""
    url = base_url.rstrip("/") + "/v1/models"
    timeout = _aiohttp().ClientTimeout(total=60)
    status, text = await fetch(session.get, base_url, url, headers=headers, timeout=timeout)
    if status != 200:
        raise ConfigError(f"GET {url} answered HTTP {status}: {text[:200]}")
    try:
        cards = json.loads(text)["data"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"GET {url} answered something other than a model list: {text[:200]!r}") from None
    lengths = [c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)]
    return ServerInfo([str(c["id"]) for c in cards if c.get("id")], min(lengths, default=None))


async def accepted_ids(session: Any, url: str, headers: dict[str, str], model: str | None, largest: int) -> int | None:
    """How many token ids the model behind ``url`` takes in a prompt, when fewer than ``largest + 1`` (else None).

    One-token prompts, one output token each: the server checks prompt ids against the model's vocabulary (which
    may be larger than its tokenizer's), answering 400 beyond it. One request when ``largest`` is taken; else a
    bisection, some twenty more."""

    async def taken(token: int) -> bool:
        body = {**({"model": model} if model else {}), "prompt": [token], "max_tokens": 1, "temperature": 0.0}
        status, text = await fetch(session.post, url, url, data=json.dumps(body), headers=headers)
        if status == 200 or (status == 400 and token > 0):
            return status == 200
        raise ConfigError(f"a one-token request to {url} answered HTTP {status}: {text[:200]}")

    if await taken(largest):
        return None
    await taken(0)  # raises unless taken: a 400 here is about something else (the model name, the endpoint)
    low, high = 0, largest  # ``low`` is taken, ``high`` is not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if await taken(middle) else (low, middle)
    return high


async def probe_server(
    base_url: str, endpoint: str, headers: dict[str, str], model: str | None, largest_id: int
) -> tuple[ServerInfo, str | None]:
    """The server's :class:`ServerInfo`, and the model name to send: ``model``, else the first of /v1/models."""
    async with client_session() as session:
        info = await read_models(session, base_url, headers)
        model = model or (info.model_ids[0] if info.model_ids else None)
        url = base_url.rstrip("/") + endpoint
        info.vocab_size = await accepted_ids(session, url, headers, model, largest_id)
    return info, model


def fit_to_server(requests: list[BenchRequest], vocab_size: int | None, max_model_len: int | None) -> list[str]:
    """Fit ``requests`` in place to the server's model: token ids beyond its vocabulary wrapped into it, and
    requests whose prompt and output together exceed ``max_model_len`` scaled down to fit, prompt and output in
    proportion; a one-line notice for each change."""
    notices = []
    if vocab_size is not None and any(t >= vocab_size for r in requests for t in r.prompt):
        for r in requests:
            r.prompt = [t % vocab_size for t in r.prompt]
        notices.append(f"token ids taken modulo the server's vocabulary size {vocab_size}")
    if max_model_len is not None:
        clipped = 0
        for r in requests:
            total = len(r.prompt) + r.max_tokens
            if total > max_model_len:
                prompt_len = max(1, len(r.prompt) * max_model_len // total)
                r.prompt = r.prompt[:prompt_len]
                r.max_tokens = min(r.max_tokens, max_model_len - prompt_len)
                clipped += 1
        if clipped:
            notices.append(
                f"{clipped} of {len(requests)} requests longer than the server's max_model_len {max_model_len} "
                "(prompt + output tokens): both lengths scaled down to fit"
            )
    return notices


def result_path(args: argparse.Namespace, model: str | None, rates: list[float]) -> Path | None:
    """Where the JSON goes: ``--result-file``, or with vLLM's ``--save-result`` (``--result-dir``,
    ``--result-filename`` imply it) that folder and name, by default named as vLLM names it."""
    if args.result_file:
        return Path(args.result_file)
    if not (args.save_result or args.result_filename or args.result_dir):
        return None
    name = args.result_filename
    if not name:
        rate = "-".join("inf" if math.isinf(r) else f"{r:g}" for r in rates)
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model_id = (model or "model").rstrip("/").split("/")[-1]
        name = f"nanovllm-{rate}qps{concurrency}-{model_id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    folder = Path(args.result_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts {args.num_prompts}: at least 1")
    if args.client_processes < 1:
        raise ConfigError(f"--client-processes {args.client_processes}: at least 1")
    if not args.endpoint.startswith("/"):
        raise ConfigError(f"--endpoint {args.endpoint!r}: a path starting with /, e.g. /v1/completions")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError(f"--vocab-size {args.vocab_size}: at least 1")
    rates = parse_rates(args.rates) if args.rates else parse_rates(str(args.request_rate))
    metrics, percentiles = parse_percentiles(args.percentile_metrics, args.metric_percentiles)
    classes = None
    if args.priorities:
        try:
            classes = [int(p) for p in args.priorities.split(",")]
        except ValueError:
            raise ConfigError(f"--priorities {args.priorities!r}: comma-separated integers, e.g. 0,1") from None
    check_dataset(args.dataset)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    vocab = args.vocab_size or DEFAULT_VOCAB_SIZE
    if args.dataset.endswith(".jsonl"):
        requests = read_trace(args.dataset, args.seed, vocab)
        if len(requests) > args.num_prompts:
            print(
                f"bench serve: the trace holds {len(requests)} requests; sending the first {args.num_prompts} "
                "(--num-prompts)",
                file=sys.stderr,
                flush=True,
            )
            requests = requests[: args.num_prompts]
        if requests[0].arrival is not None and (args.rates or math.isfinite(args.request_rate)):
            raise ConfigError(
                f"--dataset {args.dataset}: its requests carry their arrival times; drop --request-rate/--rates"
            )
    elif args.dataset == "nano":
        requests = nano_workload(args.num_prompts, args.max_input_len, args.max_output_len)
    elif args.dataset == "random":
        requests = random_dataset(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab, args.seed
        )
    else:
        requests = synthetic_sharegpt(args.num_prompts, vocab, args.seed)
    largest = max(t for r in requests for t in r.prompt)
    headers = request_headers(args.api_key)
    server, model = event_loop_runner()(
        probe_server(base_url, args.endpoint, headers, args.served_model or args.model, largest)
    )
    # ids drawn below an explicit --vocab-size stay as drawn: the server's answer to them is the user's question
    for notice in fit_to_server(requests, None if args.vocab_size else server.vocab_size, server.max_model_len):
        print(f"bench serve: {notice}", file=sys.stderr, flush=True)
    if classes:
        for i, req in enumerate(requests):
            req.priority = classes[i % len(classes)]
    runs = []
    for i, rate in enumerate(rates):
        summary = run_workload(
            base_url,
            model,
            requests,
            rate,
            args.max_concurrency,
            args.seed,
            args.temperature,
            args.api_key,
            warmup=min(args.warmup, len(requests)) if i == 0 else 0,
            processes=args.client_processes,
            endpoint=args.endpoint,
            extra=(metrics, percentiles) if percentiles else None,
        )
        summary["dataset"] = args.dataset
        if requests[0].arrival is not None:
            summary["arrivals"] = "trace"
        summary["model_id"] = model
        if args.server_metrics:
            summary["server_metrics"] = event_loop_runner()(read_server_metrics(base_url, headers))
        runs.append(summary)
        print_summary(summary, metrics, percentiles)
    path = result_path(args, model, rates)
    if path is not None:
        path.write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=2))
    return 0 if all(run["failed"] == 0 for run in runs) else 1


def print_summary(s: dict[str, Any], metrics: Sequence[str] = METRICS, percentiles: list[float] | None = None) -> None:
    rate = "inf" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g}"
    lines = [
        f"--- {s['dataset']}: {s['num_prompts']} requests at rate {rate}/s: {s['completed']} completed, "
        f"{s['failed']} failed in {s['duration']:.2f} s",
        f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:,.0f} tok/s, "
        f"total {s['total_token_throughput']:,.0f} tok/s, {s['mean_tokens_per_chunk']:.2f} tokens per chunk",
    ]
    for name in metrics:
        if percentiles is None:
            columns = [("p50", s[f"median_{name}_ms"]), ("p90", s[f"p90_{name}_ms"]), ("p99", s[f"p99_{name}_ms"])]
        else:
            columns = [(percentile_key(q, name).split("_")[0], s[percentile_key(q, name)]) for q in percentiles]
        cells = "  ".join(f"{label} {value:9.2f}" for label, value in columns)
        lines.append(f"{name.upper():>5} ms: mean {s[f'mean_{name}_ms']:9.2f}  {cells}")
    if "client_processes" in s:
        lines.append(
            f"client event loop lag ms ({s['client_processes']} process{'es' if s['client_processes'] > 1 else ''}): "
            f"mean {s['mean_client_loop_lag_ms']:.2f}  p99 {s['p99_client_loop_lag_ms']:.2f}  "
            f"max {s['max_client_loop_lag_ms']:.2f}; "
            f"longest garbage collection {s['max_client_gc_pause_ms']:.2f}; "
            f"sends late by mean {s['mean_send_lateness_ms']:.2f}  max {s['max_send_lateness_ms']:.2f}"
        )
    for priority, c in s.get("by_priority", {}).items():
        lines.append(
            f"priority {priority}: {c['completed']} requests, TTFT ms p50 {c['median_ttft_ms']:.2f} p99 "
            f"{c['p99_ttft_ms']:.2f}, ITL ms p50 {c['median_itl_ms']:.2f} p99 {c['p99_itl_ms']:.2f}"
        )
    for error in s["errors"]:
        lines.append(f"error: {error}")
    print("\n".join(lines), file=sys.stdout, flush=True)
