"""``nanovllm simulate``: replay a workload through the simulated engine and report ``nanovllm bench serve``'s
metrics (the same datasets, arrivals and summary), plus KV-cache use and preemptions over time."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from nanovllm_bench.serve import (
    DATASETS,
    RequestResult,
    check_dataset,
    nano_workload,
    parse_rates,
    print_summary,
    random_dataset,
    read_trace,
    summarize,
    synthetic_sharegpt,
)
from nanovllm_bench.simulate.cost import (
    Calibration,
    calibrate,
    client_from_timings,
    frontend_from_idle,
    frontend_from_metrics,
    frontend_from_timelines,
    load_calibration,
    pipe_from_timings,
    shipped_calibrations,
)
from nanovllm_bench.simulate.engine import RequestTimes, TraceRequest, TraceSimulator
from nanovllm_bench.simulate.frontend import FrontEndQueue
from nanovllm_core.errors import ConfigError

DEFAULT_CALIBRATION = "h200-qwen3-0.6b-bf16"
TIMELINE_POINTS = 200  # the KV-cache/preemption timeline in the JSON, evenly thinned to about this many points


def poisson_arrivals(n: int, rate: float, seed: int, processes: int = 1) -> list[float]:
    """``bench serve``'s arrivals: from ``processes`` clients, request ``i`` sent by client ``i % processes``, whose
    first request goes at 0 and the next after exponential gaps at ``rate / processes`` drawn from
    ``random.Random(seed + k)`` (``inf``: all at 0)."""
    if not rate > 0:
        raise ConfigError(f"--request-rate {rate}: must be > 0 (inf: all at once)")
    if processes < 1:
        raise ConfigError(f"--client-processes {processes}: at least 1")
    times = [0.0] * n
    for k in range(min(processes, n)):
        rng = random.Random(seed + k)
        t = 0.0
        for j, i in enumerate(range(k, n, processes)):
            if j and math.isfinite(rate):
                t += rng.expovariate(rate / processes)
            times[i] = t
    return times


def build_workload(args: argparse.Namespace, rate: float) -> list[TraceRequest]:
    """The requests of ``args.dataset`` with Poisson arrivals at ``rate`` (a timed trace keeps its own)."""
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts {args.num_prompts}: at least 1")
    timed = False
    if args.dataset == "nano":
        drawn = nano_workload(args.num_prompts, args.max_input_len, args.max_output_len)
        reqs = [TraceRequest(0.0, r.prompt, r.max_tokens) for r in drawn]
    elif args.dataset == "sharegpt-synth":
        drawn = synthetic_sharegpt(args.num_prompts, 10000, args.seed)
        reqs = [TraceRequest(0.0, r.prompt, r.max_tokens) for r in drawn]
    elif args.dataset == "random":
        reqs = [
            TraceRequest(0.0, r.prompt, r.max_tokens)
            for r in random_dataset(
                args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, 10000,
                args.seed,
            )
        ]
    elif args.dataset.endswith(".jsonl"):
        rows = read_trace(args.dataset, args.seed, 10000)[: args.num_prompts]
        timed = rows[0].arrival is not None
        reqs = [TraceRequest(r.arrival or 0.0, r.prompt, r.max_tokens, r.priority) for r in rows]
    else:
        check_dataset(args.dataset)
    if not timed:
        for req, t in zip(reqs, poisson_arrivals(len(reqs), rate, args.seed, args.client_processes)):
            req.arrival = t
    if args.priorities:
        try:
            classes = [int(p) for p in args.priorities.split(",")]
        except ValueError:
            raise ConfigError(f"--priorities {args.priorities!r}: comma-separated integers, e.g. 0,1") from None
        for i, req in enumerate(reqs):
            req.priority = classes[i % len(classes)]
    return reqs


def client_results(times: list[RequestTimes], frontend: dict[str, Any]) -> list[RequestResult]:
    """What ``bench serve`` measures of each request: a token reaches the client when the front-end delivered it
    (without delivery times, the front-end's ``delivery_ms`` after its step), and the first and last token also the
    client's own way in and out (``client_ms`` plus ``client_ms_per_1k_prompt_tokens``) later."""
    delivery_s = frontend.get("delivery_ms", 0.0) / 1e3
    results = []
    for t in times:
        req = t.request
        tokens = t.delivered or [x + delivery_s for x in t.token_times]
        result = RequestResult(prompt_tokens=len(req.prompt), priority=req.priority)
        if len(tokens) == req.max_tokens:
            client_ms = frontend.get("client_ms", 0.0) + frontend.get("client_ms_per_1k_prompt_tokens", 0.0) * (
                len(req.prompt) / 1e3
            )
            result.ok = True
            result.output_tokens = len(tokens)
            result.ttft = tokens[0] + client_ms / 1e3 - req.arrival
            result.latency = tokens[-1] + client_ms / 1e3 - req.arrival
            result.itl = [b - a for a, b in zip(tokens, tokens[1:])]
        else:
            result.error = f"{len(tokens)} of {req.max_tokens} tokens"
        results.append(result)
    return results


def simulate_once(args: argparse.Namespace, calibration: Calibration, scheduler: str, rate: float) -> dict[str, Any]:
    """One workload through one policy at one rate: ``bench serve``'s summary plus the simulation's own figures."""
    options = _json_option("--scheduler-options", args.scheduler_options)
    trace = build_workload(args, rate)
    engine = TraceSimulator(
        calibration,
        scheduler=scheduler,
        scheduler_options=options,
        block_manager=args.block_manager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kvcache_blocks=args.num_kvcache_blocks,
        async_scheduling=not args.no_async_scheduling,
    )
    wall = time.perf_counter()
    if args.warm_prefix_cache < 0:
        raise ConfigError(f"--warm-prefix-cache {args.warm_prefix_cache}: a number of prompts, 0 or more")
    if args.warm_prefix_cache:
        engine.warm_prefix_cache([r.prompt for r in trace[: args.warm_prefix_cache]])
    times = engine.replay(trace)
    wall = time.perf_counter() - wall
    results = client_results(times, calibration.frontend)
    start = min(r.arrival for r in trace)
    end = max((r.arrival + res.latency for r, res in zip(trace, results) if res.ok), default=start)
    duration = max(end - start, 1e-9)
    summary = summarize(results, duration)
    timeline = engine.timeline
    stride = max(1, len(timeline) // TIMELINE_POINTS)
    usage = [point[1] for point in timeline]
    summary.update(
        request_rate=rate,
        num_prompts=len(trace),
        dataset=args.dataset,
        scheduler=scheduler,
        scheduler_options=options,
        calibration=args.calibration,
        simulated={
            "steps": engine.steps,
            "simulated_s": engine.now,
            "wall_s": wall,
            "simulated_s_per_wall_s": engine.now / wall if wall else None,
            "gpu_busy_fraction": engine.gpu_busy / engine.now if engine.now else 0.0,
            # the front-end's CPU, where the calibration queues its work (None: fixed times)
            "frontend_busy_fraction": (
                engine.front_end.busy / engine.now if isinstance(engine.front_end, FrontEndQueue) and engine.now
                else None
            ),
            "num_preemptions": engine.scheduler.num_preemptions,
            "mean_kv_cache_usage": sum(usage) / len(usage) if usage else 0.0,
            "max_kv_cache_usage": max(usage, default=0.0),
            "timeline_fields": ["time_s", "kv_cache_usage", "running", "waiting", "preemptions"],
            "timeline": [list(p) for p in timeline[::stride]],
        },
    )
    return summary


def _json_option(flag: str, text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {text!r}: not JSON ({exc}); e.g. '{{\"option\": 1}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: a JSON object of option names to values")
    return value


def _frontend_busy(sim: dict[str, Any]) -> str:
    front = sim.get("frontend_busy_fraction")
    return "" if front is None else f"front-end CPU busy {100 * front:.0f}%, "


def print_simulated(s: dict[str, Any]) -> None:
    sim = s["simulated"]
    print(
        f"{s['scheduler']}: {sim['steps']:,} steps, {sim['simulated_s']:.2f} simulated s in {sim['wall_s']:.2f} "
        f"wall s ({sim['simulated_s_per_wall_s']:.0f} simulated s per wall-clock s); "
        f"GPU busy {100 * sim['gpu_busy_fraction']:.0f}%, "
        f"{_frontend_busy(sim)}"
        f"KV cache use mean {100 * sim['mean_kv_cache_usage']:.0f}% max {100 * sim['max_kv_cache_usage']:.0f}%, "
        f"{sim['num_preemptions']} preemptions",
        flush=True,
    )


def plot_sweep(runs: list[dict[str, Any]], path: str) -> None:
    """TTFT and ITL (p50 dashed, p99 solid) against request rate, one line per scheduler, in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "itl")):
        for scheduler in dict.fromkeys(r["scheduler"] for r in runs):
            mine = sorted((r for r in runs if r["scheduler"] == scheduler), key=lambda r: r["request_rate"])
            rates = [r["request_rate"] for r in mine]
            (line,) = ax.plot(rates, [r[f"p99_{metric}_ms"] for r in mine], marker="o", label=f"{scheduler} p99")
            p50 = [r[f"median_{metric}_ms"] for r in mine]
            ax.plot(rates, p50, ls="--", color=line.get_color(), label=f"{scheduler} p50")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"nanovllm simulate: {runs[0]['dataset']}, calibration {runs[0]['calibration']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scheduler", action="append", help="scheduler policy by registered name, or module:Class for one not "
        "installed yet (repeatable with --sweep-rates; default fifo)",
    )
    parser.add_argument("--scheduler-options", help="the policy's options as a JSON object")
    parser.add_argument("--block-manager", default="prefix_cache", help="block manager by registered name")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="most new tokens a step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences a step")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-kvcache-blocks", type=int, help="KV-cache blocks (default: the calibration's GPU's)")
    parser.add_argument(
        "--cuda-graph-max-mixed-tokens",
        type=int,
        help="steps with prompt tokens up to this many replay CUDA graphs, larger ones run eagerly (default: the "
        "calibration's, the setting of the servers it was fitted on)",
    )
    parser.add_argument("--no-async-scheduling", action="store_true", help="schedule each step after the last ends")
    parser.add_argument(
        "--calibration", default=DEFAULT_CALIBRATION,
        help="step-time calibration: a shipped name or a JSON file (default %(default)s; --list-calibrations)",
    )
    parser.add_argument("--list-calibrations", action="store_true", help="print the shipped calibrations and exit")
    parser.add_argument("--dataset", default="sharegpt-synth", help=f"{', '.join(DATASETS)} or a trace.jsonl")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    parser.add_argument("--sweep-rates", help="comma-separated request rates, one simulation each per scheduler")
    parser.add_argument("--plot", help="with --sweep-rates: draw latency against rate to this PNG (needs matplotlib)")
    parser.add_argument("--priorities", help="priority classes given to the requests in turn, e.g. 0,1")
    parser.add_argument(
        "--client-processes", type=int, default=1,
        help="arrivals as bench serve --client-processes N sends them: request i from client i mod N, each client "
        "Poisson at rate/N with seed+k",
    )
    parser.add_argument(
        "--warm-prefix-cache", type=int, default=0, metavar="N",
        help="start with the workload's first N prompts in the prefix cache, as on a server that ran the same "
        "workload before (bench serve runs its rates one after another on one server; a saturation run first)",
    )
    parser.add_argument("--max-input-len", type=int, default=1024, help="nano workload: longest prompt")
    parser.add_argument("--max-output-len", type=int, default=1024, help="nano workload: longest output")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths and the arrivals")
    parser.add_argument("--result-file", help="write the results as JSON here")
    parser.add_argument(
        "--calibrate", nargs="+", metavar="BENCH_JSON",
        help="fit a calibration from nanovllm bench --json results (one GPU, shape, KV dtype) and write it to --out",
    )
    parser.add_argument("--out", help="with --calibrate: the calibration file to write")
    parser.add_argument("--commit", help="with --calibrate: the bench run's commit, when its JSON lacks one")
    parser.add_argument("--date", help="with --calibrate: the bench run's date, when its JSON lacks one")
    parser.add_argument(
        "--frontend-metrics", nargs="+", metavar="METRICS_TXT",
        help="with --calibrate: a nanovllm serve /metrics scrape (and optionally an earlier one of the same server, "
        "subtracted) whose mean request intake time and output delivery lag become the per-request front-end time",
    )
    parser.add_argument(
        "--request-timelines", nargs="+", metavar="JSONL",
        help="with --calibrate: nanovllm serve --request-timeline files, from which the front-end's time per request "
        "(a fixed part and a part per prompt token) and its output hand-over are fitted, in place of "
        "--frontend-metrics",
    )
    parser.add_argument(
        "--client-timings", nargs="+", metavar="JSON",
        help="with --calibrate: benchmarks/request_timeline.py --json files of an idle server, from which the "
        "client's own part of a first token's time (outside the server) is fitted and added to every simulated TTFT "
        "and latency, and, with --request-timelines, the hop to the engine process with no step to wait for; "
        "without --request-timelines or --frontend-metrics, the whole front-end (its stages on the idle server)",
    )


def run_simulate(args: argparse.Namespace) -> int:
    if args.list_calibrations:
        for name in shipped_calibrations():
            cal = load_calibration(name)
            print(f"{name}: {cal.gpu}, {cal.model}, KV {cal.kv_cache_dtype}, commit {cal.commit}, {cal.date}, "
                  f"r2 {cal.fit.get('r2', float('nan')):.4f}")
        return 0
    if args.calibrate:
        if not args.out:
            raise ConfigError("--calibrate needs --out FILE (where the calibration is written)")
        if args.frontend_metrics and args.request_timelines:
            raise ConfigError("--frontend-metrics or --request-timelines: the front-end is fitted from one of them")
        frontend = frontend_from_metrics(args.frontend_metrics) if args.frontend_metrics else None
        client = client_from_timings(args.client_timings) if args.client_timings else None
        if args.request_timelines:
            pipe = pipe_from_timings(args.client_timings) if args.client_timings else None
            frontend = frontend_from_timelines(args.request_timelines, pipe)
        elif frontend is None and args.client_timings:
            frontend = frontend_from_idle(args.client_timings)
        cal = calibrate(args.calibrate, commit=args.commit, date=args.date, frontend=frontend, client=client)
        Path(args.out).write_text(cal.to_json())
        c = cal.coefficients_ms
        print(
            f"wrote {args.out}: {cal.gpu}, {cal.model}, KV {cal.kv_cache_dtype}: {c['fixed']:.3f} ms a step + "
            f"{1e3 * c['per_seq']:.2f} us a sequence + {1e6 * c['per_kv_token']:.2f} ns a KV token + "
            f"{1e3 * c['per_prompt_token']:.3f} us a prompt token; r2 {cal.fit['r2']:.4f} over "
            f"{cal.fit['records']} steps"
        )
        if cal.graph_max_tokens is not None:
            print(
                f"  a prompt step + {c['per_prompt_step']:.3f} ms, a prompt pair {1e6 * c['per_prompt_pair']:.3f} ns; "
                f"above {cal.graph_max_tokens:,} tokens (eager) + {1e3 * c['eager_per_prompt_token']:.3f} us a prompt "
                f"token, at least {c['eager_floor']:.2f} ms"
            )
        for source, q in cal.fit.get("per_source", {}).items():
            errors = {kind: q[f"{kind}_steps_mean_abs_error_pct"] for kind in ("decode", "prompt")}
            shown = ", ".join(f"{e:.1f}% of {kind} steps" for kind, e in errors.items() if e is not None)
            print(f"  {source}: mean abs error {shown}")
        f = cal.frontend
        if "output_cpu_ms_per_token" in f:
            print(f"  front-end, queued on one CPU: {f['cpu_ms_per_request']:.3f} ms a request of "
                  f"{f['cpu_prompt_tokens']} prompt tokens and one output token, {f['output_cpu_ms_per_token']:.4f} ms "
                  f"each further token, {f.get('output_cpu_ms_per_step', 0.0):.4f} ms each step's outputs "
                  f"({f['cpu_source']})")  # fmt: skip
        return 0
    calibration = load_calibration(args.calibration)
    if args.cuda_graph_max_mixed_tokens is not None:
        if args.cuda_graph_max_mixed_tokens < 0:
            raise ConfigError(f"--cuda-graph-max-mixed-tokens {args.cuda_graph_max_mixed_tokens}: give 0 or more")
        if calibration.graph_max_tokens is None:
            raise ConfigError(
                f"--cuda-graph-max-mixed-tokens: calibration {args.calibration or 'default'} has no eager terms "
                "(fitted before they were): it prices every step alike"
            )
        calibration = dataclasses.replace(calibration, graph_max_tokens=args.cuda_graph_max_mixed_tokens)
    schedulers = args.scheduler or ["fifo"]
    if args.plot and not args.sweep_rates:
        raise ConfigError("--plot draws a --sweep-rates run: give --sweep-rates R1,R2,...")
    if len(schedulers) > 1 and not args.sweep_rates:
        raise ConfigError("several --scheduler need --sweep-rates (one simulation per scheduler and rate)")
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    if args.plot:  # fail before the simulations, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    runs = []
    for scheduler in schedulers:
        for rate in rates:
            summary = simulate_once(args, calibration, scheduler, rate)
            runs.append(summary)
            print_summary(summary)
            print_simulated(summary)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=2))
    if args.plot:
        plot_sweep(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(run["failed"] == 0 for run in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm simulate")
    add_simulate_arguments(parser)
    try:
        return run_simulate(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
