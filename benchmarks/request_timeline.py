"""Where an idle server's time to first token goes: long and short prompts sent one at a time to a running
``nanovllm serve ... --request-timeline FILE``, each timed by this client to its first streamed token, then
the server's timeline of each split into its stages.

    nanovllm serve MODEL --request-timeline /tmp/timeline.jsonl [--step-records-file steps.json] ... &
    python benchmarks/request_timeline.py --timeline /tmp/timeline.jsonl [--long 20000 --short 200 --runs 3]

Prompts are fresh random token ids (the prefix cache has seen none of them), sent as token ids, ``max_tokens``
1. Stages (median over the runs, ms): ``received -> validated`` (HTTP body, its validation, the prompt check),
``validated -> handed`` (the front-end's hand-over), ``handed -> engine_arrival`` (the pipe to the engine, and
the wait for the running step), ``engine_arrival -> first_scheduled`` (the engine's queue),
``first_scheduled -> prompt_scheduled`` (the prompt's chunks before its last), ``prompt_scheduled ->
first_token`` (the last chunk's step and the read of its token), ``first_token -> first_token_delivered`` (the
hand-over back) and what the client saw beyond ``received -> first_token_delivered`` (the HTTP reply's way out
and the request's way in). Standard library only: it runs beside any server.

``--cpu-requests N`` then measures the front-end's CPU (the server process's ``process_cpu_seconds_total`` and
the engine's steps, read from ``/metrics`` before and after each burst): N short-prompt requests of one output
token, then N of ``--cpu-output-tokens`` each, ``--cpu-concurrency`` at a time, then a few longer ones one at a
time. Solved for the CPU a request takes, each streamed token and each engine step's outputs: what ``nanovllm
simulate`` charges the front-end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

STAGES = ("received", "validated", "handed", "engine_arrival", "first_scheduled", "prompt_scheduled", "first_token",
          "first_token_delivered")  # fmt: skip


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def first_token_seconds(
    host: str, port: int, model: str, prompt: list[int], api_key: str | None, max_tokens: int = 1
) -> float:
    """Send one streamed completion of ``prompt``; seconds from the request's first byte to its first token (the
    rest of the stream is read to its end)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=_headers(api_key))
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"error: the server answered {response.status}: {response.read()[:300]!r}")
    while True:
        line = response.readline()
        if not line:
            raise SystemExit("error: the stream ended before a token")
        if line.startswith(b"data: ") and b'"text"' in line:
            seconds = time.perf_counter() - start
            break
    response.read()
    conn.close()
    return seconds


def server_counters(host: str, port: int, api_key: str | None) -> tuple[float, float]:
    """The server process's CPU seconds and the engine's steps so far (``process_cpu_seconds_total`` and
    ``nanovllm:step_loop_steps_total`` on ``/metrics``)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics", headers=_headers(api_key))
    text = conn.getresponse().read().decode()
    conn.close()
    cpu = steps = None
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            cpu = float(line.split()[1])
        elif line.startswith("nanovllm:step_loop_steps_total"):
            steps = (steps or 0.0) + float(line.rsplit(" ", 1)[1])
    if cpu is None or steps is None:
        raise SystemExit("error: the server's /metrics lacks process_cpu_seconds_total or "
                         "nanovllm:step_loop_steps_total (a nanovllm serve on Linux has both)")  # fmt: skip
    return cpu, steps


def solve(rows: list[list[float]], values: list[float]) -> list[float]:
    """``x`` with ``rows @ x == values`` (a square system, Gaussian elimination with partial pivoting)."""
    a = [row[:] + [v] for row, v in zip(rows, values)]
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def timeline_lines(path: Path) -> int:
    """Lines the server's timeline holds so far."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def records_since(path: Path, before: int, complete: Callable[[list[dict]], bool], timeout: float = 5.0) -> list[dict]:
    """The requests' records written after the timeline's first ``before`` lines (its clock lines left out), once
    they are ``complete`` (the server writes a request's line as it finishes, which can be after the client has
    read its last token), else as they stand ``timeout`` seconds on."""
    deadline = time.monotonic() + timeout
    while True:
        last_look = time.monotonic() > deadline
        # whole lines only: the last one may be half written
        lines = path.read_text().split("\n")[:-1] if path.exists() or last_look else []
        records = [r for r in map(json.loads, lines[before:]) if "clock" not in r]
        if complete(records) or last_look:
            return records
        time.sleep(0.01)


def frontend_cpu(args: argparse.Namespace, model: str, rng: random.Random) -> dict:
    """The front-end's CPU a request, a streamed token and an engine step (whose outputs it takes in as one
    message): three bursts of short prompts, the server's CPU and the engine's steps read before and after each,
    solved for the three. N requests of one output token ``--cpu-concurrency`` at a time, N of
    ``--cpu-output-tokens``, then a few longer ones one at a time, whose every step carries one token."""
    from concurrent.futures import ThreadPoolExecutor

    def burst(count: int, max_tokens: int, concurrency: int) -> list[float]:
        prompts = [[rng.randrange(10, args.max_token_id) for _ in range(args.short)] for _ in range(count)]
        cpu, steps = server_counters(args.host, args.port, args.api_key)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: first_token_seconds(args.host, args.port, model, p, args.api_key, max_tokens),
                          prompts))  # fmt: skip
        cpu_after, steps_after = server_counters(args.host, args.port, args.api_key)
        return [count, count * max_tokens, steps_after - steps, cpu_after - cpu]

    n, k = args.cpu_requests, args.cpu_output_tokens
    bursts = [burst(n, 1, args.cpu_concurrency), burst(n, k, args.cpu_concurrency)]
    before = timeline_lines(args.timeline)
    num_alone = max(4, n // 32)
    bursts.append(burst(num_alone, 4 * k, 1))
    alone = records_since(
        args.timeline, before, lambda records: sum(r.get("num_output_tokens") == 4 * k for r in records) >= num_alone
    )
    per_request, per_token, per_step = solve([b[:3] for b in bursts], [b[3] for b in bursts])
    return {
        "requests": n, "prompt_tokens": args.short, "output_tokens": k, "concurrency": args.cpu_concurrency,
        "bursts": [dict(zip(("requests", "output_tokens", "steps", "cpu_s"), b)) for b in bursts],
        "ms_per_request": 1e3 * (per_request + per_token), "ms_per_output_token": 1e3 * per_token,
        "ms_per_step": 1e3 * per_step, "alone": step_cycle_alone(alone, args.short, 4 * k),
    }  # fmt: skip


def step_cycle_alone(records: list[dict], prompt_tokens: int, output_tokens: int) -> dict:
    """The engine's time from one step's tokens to the next's for a request alone (the last burst's, one at a time):
    its decode span as the engine stamped it over its steps. Beyond the step itself this holds the engine's host
    work between steps, which a server's step records do not."""
    spans = [(r["finished"] - r["first_token"]) / (output_tokens - 1) for r in records
             if r.get("num_output_tokens") == output_tokens and r.get("finished") and r.get("first_token")]  # fmt: skip
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requests": len(spans), "ms_per_step": 1e3 * statistics.median(spans) if spans else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeline", type=Path, required=True, help="the server's --request-timeline file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--long", type=int, default=20000, help="tokens of a long prompt")
    parser.add_argument("--short", type=int, default=200, help="tokens of a short prompt")
    parser.add_argument("--runs", type=int, default=3, help="prompts of each length, one at a time")
    parser.add_argument("--max-token-id", type=int, default=10000, help="prompts draw ids from 10 to this")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--cpu-requests", type=int, default=0, help="then measure the front-end's CPU over N requests")
    parser.add_argument("--cpu-output-tokens", type=int, default=32, help="output tokens of the second burst")
    parser.add_argument("--cpu-concurrency", type=int, default=16, help="requests in flight in each burst")
    args = parser.parse_args(argv)
    if args.cpu_requests < 0 or args.cpu_output_tokens < 2 or args.cpu_concurrency < 1:
        parser.error("--cpu-requests is 0 or more, --cpu-output-tokens 2 or more, --cpu-concurrency 1 or more")
    model = args.model
    if model is None:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
    rng = random.Random(0)
    before = timeline_lines(args.timeline)
    client: dict[str, list[float]] = {"long": [], "short": []}
    for _ in range(args.runs):
        for kind, length in (("long", args.long), ("short", args.short)):
            prompt = [rng.randrange(10, args.max_token_id) for _ in range(length)]
            client[kind].append(first_token_seconds(args.host, args.port, model, prompt, args.api_key))
    records = records_since(args.timeline, before, lambda records: len(records) >= 2 * args.runs)
    result: dict = {"model": model, "runs": args.runs}
    for kind, length in (("long", args.long), ("short", args.short)):
        mine = [r for r in records if r["num_prompt_tokens"] == length]
        stages = {
            f"{a} -> {b}": 1e3 * statistics.median(r[b] - r[a] for r in mine) for a, b in zip(STAGES, STAGES[1:])
        }  # fmt: skip
        server = 1e3 * statistics.median(r["first_token_delivered"] - r["received"] for r in mine)
        seen = 1e3 * statistics.median(client[kind])
        result[kind] = {"prompt_tokens": length, "client_ttft_ms": seen, "server_ttft_ms": server,
                        "outside_server_ms": seen - server, "stages_ms": stages}  # fmt: skip
        print(f"{kind} prompt ({length} tokens): first token {seen:.1f} ms at the client, {server:.1f} ms from the "
              f"server's receipt to its hand-over of the token (medians of {len(mine)})")  # fmt: skip
        for name, ms in stages.items():
            print(f"  {name:<44} {ms:9.2f} ms")
        print(f"  {'the way in and out (client minus server)':<44} {seen - server:9.2f} ms")
    if args.cpu_requests:
        cpu = result["frontend_cpu"] = frontend_cpu(args, model, rng)
        print(f"front-end CPU: {cpu['ms_per_request']:.3f} ms a request of {args.short} prompt tokens and one output "
              f"token, {cpu['ms_per_output_token']:.4f} ms each further streamed token, {cpu['ms_per_step']:.4f} ms "
              f"each engine step's outputs ({args.cpu_requests} requests a burst, {args.cpu_concurrency} at a "
              "time)")  # fmt: skip
        if cpu["alone"]["ms_per_step"] is not None:
            print(f"a request alone: {cpu['alone']['ms_per_step']:.3f} ms from one step's token to the next's "
                  f"(median of {cpu['alone']['requests']})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
