"""A bounded soak of ``nanovllm serve`` on the CPU demo model: many requests near saturation, some of them abusive.

    python benchmarks/soak.py                          # 20,000 requests (make soak)
    python benchmarks/soak.py --num-requests 2000      # a shorter run

In turn:

1. ``nanovllm serve`` of the demo checkpoint (a tiny random-weight Qwen3: 384 token ids, max_model_len 1024) on
   127.0.0.1, with ``--max-request-body-bytes`` set, ready once ``/health`` answers;
2. saturation: ``--saturation-requests`` requests of the soak's shape at once; their request rate is the server's
   capacity (this also warms the server up);
3. the soak: ``--num-requests`` requests, Poisson arrivals at ``--load`` (70%) of that capacity, token-id prompts
   (``--input-len``, ``--output-len``, lengths varying by half either way), streamed; ``--disconnect-fraction``
   (10%) of the clients close their connection after the first few chunks; ``--bad-fraction`` (1%) send a body
   over the limit (413 expected) or an invalid request (400 expected: broken JSON, a bad field, a non-finite
   temperature, a prompt longer than max_model_len);
4. once the server is idle: the KV blocks still in use (``/metrics``: must be 0), the memory drift (RSS of the
   server and its engine process) from when the first 10% of the soak had been sent to the end (must stay under
   ``--max-memory-drift-mb``), and the server stopped with SIGTERM (exit 0).

Unexpected errors: a normal request that failed, a disconnecting client that got no stream, an abusive request
answered other than expected, a traceback in the server's log. The p99 latencies are over the normal requests.
Results go to RESULTS_DIR/soak/: soak.json, the server's log and its /metrics before and after. Exit status 0 when
every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    Server,
    add_common_arguments,
    add_server_arguments,
    check_cli,
    commit,
    out_dir,
    require_positive,
    serve_command,
    user_command,
    write_json,
)
from nanovllm_bench.serve import (
    BenchRequest,
    RequestResult,
    SSEDecoder,
    client_session,
    event_loop_runner,
    random_dataset,
    request_body,
    request_headers,
    send,
    summarize,
)
from nanovllm_bench.serve import metric_totals as metric_values

BAD_KINDS = ("oversized", "broken_json", "bad_field", "non_finite", "too_long")
EXPECTED_STATUS = {"oversized": 413, "broken_json": 400, "bad_field": 400, "non_finite": 400, "too_long": 400}
MAX_MODEL_LEN = 1024  # the demo checkpoint's max_position_embeddings
WARMUP_FRACTION = 0.1  # the memory baseline is read once this much of the soak has been sent


@dataclass
class Outcome:
    """One soak request: its kind, and for a normal one the streamed result; ``unexpected`` says what went wrong."""

    kind: str
    result: RequestResult | None = None
    unexpected: str = ""
    chunks_read: int = 0


@dataclass
class SoakRun:
    outcomes: list[Outcome] = field(default_factory=list)
    duration: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, dry_run=False)
    parser.add_argument("--num-requests", type=int, default=20000, help="requests in the soak (default 20000)")
    parser.add_argument("--load", type=float, default=0.7, help="request rate as a fraction of saturation (0.7)")
    parser.add_argument("--saturation-requests", type=int, default=300, help="requests sent at once (default 300)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1, help="clients that hang up mid-stream")
    parser.add_argument("--bad-fraction", type=float, default=0.01, help="oversized or invalid requests")
    parser.add_argument("--input-len", type=int, default=32, help="mean prompt length in tokens (default 32)")
    parser.add_argument("--output-len", type=int, default=16, help="mean output length in tokens (default 16)")
    parser.add_argument(
        "--max-request-body-bytes", type=int, default=65536, help="the server's body limit (default 65536)"
    )
    parser.add_argument("--max-memory-drift-mb", type=float, default=50.0, help="the drift allowed (default 50)")
    add_server_arguments(parser, port=8123, start_timeout=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="", help="more flags for nanovllm serve, e.g. '--max-num-seqs 64'")
    return parser


def check_args(args: argparse.Namespace) -> None:
    require_positive(args, "num_requests", "saturation_requests", "input_len", "output_len", "max_request_body_bytes")
    if not 0 < args.load <= 1:
        raise SystemExit(f"error: --load {args.load}: a fraction of the saturation rate, above 0 up to 1")
    for name in ("disconnect_fraction", "bad_fraction"):
        if not 0 <= getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: from 0 up to, not including, 1")
    if args.disconnect_fraction + args.bad_fraction >= 1:
        raise SystemExit("error: --disconnect-fraction and --bad-fraction together must leave some normal requests")
    if (args.input_len + args.output_len) * 1.5 > MAX_MODEL_LEN:
        raise SystemExit(
            f"error: --input-len + --output-len, half as long again, must fit max_model_len {MAX_MODEL_LEN}"
        )


# --- the server's process and /metrics ----------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``)."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in Path(f"/proc/{pids[index]}/task").glob("*"):
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        index += 1
    return pids


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(pid: int) -> dict[str, float]:
    """RSS in MB of the server process and each process under it (the engine process), by pid."""
    return {str(p): mb for p in process_tree(pid) if (mb := rss_mb(p)) is not None}


def fetch_metrics(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return response.read().decode()


def wait_idle(base_url: str, timeout: float = 120) -> dict[str, float]:
    """The metrics once no request is running or waiting (or the last read, after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(fetch_metrics(base_url))
        busy = values.get("nanovllm:num_requests_running", 0) + values.get("nanovllm:num_requests_waiting", 0)
        if busy == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def kv_blocks_in_use(values: dict[str, float]) -> float | None:
    if "nanovllm:num_kv_blocks" in values and "nanovllm:num_free_kv_blocks" in values:
        return values["nanovllm:num_kv_blocks"] - values["nanovllm:num_free_kv_blocks"]
    usage = values.get("vllm:kv_cache_usage_perc", values.get("nanovllm:kv_cache_usage_perc"))
    return None if usage is None else usage  # a fraction: 0 when nothing is held


# --- the load -------------------------------------------------------------------------------------------------


def bad_body(kind: str, request: BenchRequest, body_limit: int) -> bytes:
    body = request_body(request, None, 0.6)
    if kind == "oversized":
        body["prompt"] = "x" * (2 * body_limit)
    elif kind == "bad_field":
        body["max_tokens"] = -1
    elif kind == "too_long":
        body["prompt"] = [1] * (MAX_MODEL_LEN + 100)
    if kind == "non_finite":
        return json.dumps(body).replace('"temperature": 0.6', '"temperature": NaN').encode()
    if kind == "broken_json":
        return json.dumps(body).encode()[:-5]
    return json.dumps(body).encode()


async def send_bad(session: Any, url: str, headers: dict[str, str], kind: str, data: bytes) -> Outcome:
    outcome = Outcome(kind)
    try:
        async with session.post(url, data=data, headers=headers) as response:
            await response.read()
            if response.status != EXPECTED_STATUS[kind]:
                outcome.unexpected = f"{kind}: HTTP {response.status}, expected {EXPECTED_STATUS[kind]}"
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        outcome.unexpected = f"{kind}: {type(exc).__name__}: {exc}"
    return outcome


async def send_and_hang_up(
    session: Any, url: str, headers: dict[str, str], body: dict[str, Any], after: int
) -> Outcome:
    """Stream ``body`` and close the connection once ``after`` events have arrived (mid-stream)."""
    outcome = Outcome("disconnect")
    decoder = SSEDecoder()
    try:
        async with session.post(url, data=json.dumps(body), headers=headers) as response:
            if response.status != 200:
                outcome.unexpected = f"disconnect: HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for raw in response.content.iter_any():
                outcome.chunks_read += len(decoder.feed(raw))
                if outcome.chunks_read >= after:
                    response.close()  # the connection itself: the server sees the client gone
                    break
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        outcome.unexpected = f"disconnect: {type(exc).__name__}: {exc}"
    return outcome


async def run_load(
    base_url: str,
    requests: list[BenchRequest],
    kinds: list[str],
    rate: float,
    seed: int,
    body_limit: int,
    on_sent: Callable[[int], None] | None = None,
) -> SoakRun:
    url = base_url + "/v1/completions"
    headers = request_headers(None)
    rng = random.Random(seed)
    run = SoakRun()
    async with client_session() as session:

        async def one(request: BenchRequest, kind: str) -> Outcome:
            if kind == "normal":
                result = await send(session, url, request_body(request, None, 0.6), headers)
                return Outcome(kind, result, "" if result.ok else f"normal: {result.error}")
            if kind == "disconnect":
                after = rng.randint(1, max(1, min(4, request.max_tokens - 1)))
                return await send_and_hang_up(session, url, headers, request_body(request, None, 0.6), after)
            return await send_bad(session, url, headers, kind, bad_body(kind, request, body_limit))

        tasks = []
        start = time.monotonic()
        for i, (request, kind) in enumerate(zip(requests, kinds)):
            if i and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(one(request, kind)))
            if on_sent is not None:
                on_sent(i + 1)
        run.outcomes = list(await asyncio.gather(*tasks))
        run.duration = time.monotonic() - start
    return run


def draw_kinds(count: int, disconnect: float, bad: float, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    kinds = []
    for _ in range(count):
        u = rng.random()
        kinds.append("disconnect" if u < disconnect else rng.choice(BAD_KINDS) if u < disconnect + bad else "normal")
    return kinds


def vocab_size(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


# --- the run --------------------------------------------------------------------------------------------------


def soak(args: argparse.Namespace, argv: list[str]) -> int:
    from nanovllm_core.demo import ensure_demo_checkpoint

    folder = out_dir(args.results_dir, "soak")
    checkpoint = ensure_demo_checkpoint()
    cmd = serve_command(
        str(checkpoint), args.port, MAX_MODEL_LEN, "--max-request-body-bytes", str(args.max_request_body_bytes),
        *args.engine_args.split(),
    )  # fmt: skip
    check_cli(cmd)
    vocab = vocab_size(checkpoint)
    runner = event_loop_runner()
    report: dict[str, Any] = {"command": user_command("benchmarks/soak.py", argv), "commit": commit()}
    with Server(cmd, folder / "server.log", args.port, args.start_timeout) as server:
        assert server.proc is not None
        saturation = random_dataset(args.saturation_requests, args.input_len, args.output_len, 0.5, vocab, args.seed)
        print(f"saturation: {len(saturation)} requests at once", flush=True)
        run = runner(run_load(server.base_url, saturation, ["normal"] * len(saturation), math.inf, args.seed, 0))
        sat = summarize([o.result for o in run.outcomes if o.result is not None], run.duration)
        if sat["failed"]:
            print(f"error: {sat['failed']} saturation requests failed: {sat['errors']}", file=sys.stderr)
            return 1
        capacity = sat["request_throughput"]
        rate = args.load * capacity
        wait_idle(server.base_url)
        (folder / "metrics_before.txt").write_text(fetch_metrics(server.base_url))
        memory_saturation = memory(server.proc.pid)
        print(f"saturation {capacity:.1f} req/s; soak at {rate:.1f} req/s", flush=True)

        requests = random_dataset(args.num_requests, args.input_len, args.output_len, 0.5, vocab, args.seed + 7)
        kinds = draw_kinds(len(requests), args.disconnect_fraction, args.bad_fraction, args.seed)
        print(f"soak: {len(requests)} requests, ~{len(requests) / rate:.0f} s", flush=True)
        # the baseline: once the first WARMUP_FRACTION of the soak is sent (the server at its working set)
        warm_count = max(1, int(WARMUP_FRACTION * len(requests)))
        memory_before: dict[str, float] = {}

        def on_sent(sent: int) -> None:
            if sent == warm_count:
                memory_before.update(memory(server.proc.pid))

        load = run_load(server.base_url, requests, kinds, rate, args.seed, args.max_request_body_bytes, on_sent)
        run = runner(load)
        values = wait_idle(server.base_url)
        metrics_after = fetch_metrics(server.base_url)
        (folder / "metrics_after.txt").write_text(metrics_after)
        memory_after = memory(server.proc.pid)
    log = (folder / "server.log").read_text(errors="replace")
    normal = [o.result for o in run.outcomes if o.kind == "normal" and o.result is not None]
    summary = summarize(normal, run.duration)
    unexpected = [o.unexpected for o in run.outcomes if o.unexpected]
    tracebacks = log.count("Traceback (most recent call last)")
    in_use = kv_blocks_in_use(values)
    drift = {pid: memory_after[pid] - mb for pid, mb in memory_before.items() if pid in memory_after}
    total_drift = sum(drift.values())
    counts = {kind: kinds.count(kind) for kind in ("normal", "disconnect", *BAD_KINDS)}
    report.update(
        num_requests=len(requests),
        counts=counts,
        saturation_req_per_s=capacity,
        soak_rate_req_per_s=rate,
        achieved_req_per_s=len(requests) / run.duration,
        duration_s=run.duration,
        unexpected_errors=len(unexpected) + tracebacks,
        unexpected_examples=sorted(set(unexpected))[:10],
        server_tracebacks=tracebacks,
        kv_blocks_in_use_after=in_use,
        rss_mb_after_saturation_run=memory_saturation,
        rss_mb_after_warmup=memory_before,
        rss_mb_at_end=memory_after,
        rss_drift_mb=drift,
        rss_drift_total_mb=total_drift,
        server_exit_code=server.exit_code,
        p99_ttft_ms=summary["p99_ttft_ms"],
        p99_itl_ms=summary["p99_itl_ms"],
        p99_tpot_ms=summary["p99_tpot_ms"],
        p99_e2el_ms=summary["p99_e2el_ms"],
        median_e2el_ms=summary["median_e2el_ms"],
        normal_completed=summary["completed"],
        output_throughput=summary["output_throughput"],
        cpu_count=os.cpu_count(),
    )
    checks = {
        "no unexpected errors": report["unexpected_errors"] == 0,
        "no KV blocks in use after the run": in_use == 0,
        f"memory drift under {args.max_memory_drift_mb:g} MB": total_drift < args.max_memory_drift_mb,
        "server exit status 0 on SIGTERM": server.exit_code == 0,
    }
    report["checks"] = checks
    write_json(folder / "soak.json", report)
    print(
        f"soak: {len(requests)} requests ({counts['disconnect']} disconnecting, "
        f"{sum(counts[k] for k in BAD_KINDS)} oversized or invalid) in {run.duration:.1f} s at "
        f"{rate:.1f} req/s ({args.load:g} of saturation {capacity:.1f} req/s)\n"
        f"unexpected errors {report['unexpected_errors']}, KV blocks in use after {in_use}, "
        f"RSS drift {total_drift:+.1f} MB ({', '.join(f'{mb:+.1f}' for mb in drift.values())} by process)\n"
        f"p99 ms: TTFT {summary['p99_ttft_ms']:.1f}, ITL {summary['p99_itl_ms']:.1f}, "
        f"TPOT {summary['p99_tpot_ms']:.1f}, E2EL {summary['p99_e2el_ms']:.1f}"
    )
    planned = len(requests) / rate
    if run.duration > 1.5 * planned:
        print(
            f"notice: the soak took {run.duration:.0f} s for {planned:.0f} s of arrivals: the server fell behind (a "
            "machine busier than during the saturation run?), so this was not a run at the intended load"
        )
    for example in report["unexpected_examples"]:
        print(f"unexpected: {example}")
    for name, ok in checks.items():
        print(f"{'pass' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    check_args(args)
    # SIGTERM ends the run as Ctrl-C does: through the server's context, which stops the server too
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return soak(args, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
