"""Does serving cost the step loop throughput? The same workload three ways, on whatever device is here:

1. offline: ``LLM.generate`` (the engine alone);
2. async: ``AsyncLLM`` in this process, every request consumed by its own asyncio task that renders each delta
   as the server would (an OpenAI SSE chunk), so the event loop competes with the step-loop thread for the GIL;
3. http: ``nanovllm serve`` in a subprocess and the streaming client (``nanovllm bench serve``'s) in this one;
   http-process: the same with ``--engine-process`` (the step loop in a process of its own).

Each also reports the time spent inside ``step()``: if the GIL (or a busy CPU) slowed the step loop, step time
grows; if the loop waited on the event loop, wall time grows beyond step time. The HTTP modes report the CPU
time of the server's front-end (its process, less the step-loop thread) per output token.

    python benchmarks/serving_overhead.py [--shape tiny] [--num-seqs 128] [--max-len 256] [--threads 1]

The numbers in docs/serving.md come from this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.benchmark import random_checkpoint, workload
from nanovllm_core.serving.async_llm import AsyncLLM
from nanovllm_core.serving.bench import BenchRequest, run_workload
from nanovllm_core.serving.protocol import CompletionChoice, CompletionResponse

TEMPERATURE = 0.6


def offline(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m) for m in max_tokens]
    step = llm.step
    spent = [0.0]

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            spent[0] += time.perf_counter() - start

    llm.step = timed_step  # type: ignore[method-assign]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    del llm.step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "step_s": spent[0], "tokens": tokens, "tok_per_s": tokens / wall}


async def through_async_llm(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, float]:
    engine = AsyncLLM(llm)
    await engine.start()

    async def consume(i: int, prompt: list[int], m: int) -> int:
        params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m)
        n = 0
        async for out in engine.generate(prompt, params, request_id=f"bench-{i}"):
            c = out.outputs[0]
            n += len(c.token_ids)
            choice = CompletionChoice(index=0, text=c.text, finish_reason=c.finish_reason)
            CompletionResponse(id="cmpl-x", model="m", choices=[choice]).model_dump_json()  # the server's work
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(consume(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))))
    wall = time.perf_counter() - start
    step_s = engine.account.step_seconds
    await engine.shutdown()
    tokens = sum(counts)
    return {"wall_s": wall, "step_s": step_s, "tokens": tokens, "tok_per_s": tokens / wall}


def through_http(
    model: str, args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int], engine_process: bool
) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "nanovllm_core.cli", "serve", model, "--port", str(port), "--log-level", "warning"]
    cmd += ["--max-model-len", "4096", "--max-num-seqs", "256", "--no-enable-prefix-caching"]
    cmd += ["--engine-process"] if engine_process else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(cmd, env=env)
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
        requests = [BenchRequest(p, m) for p, m in zip(prompts, max_tokens)]
        url = f"http://127.0.0.1:{port}"
        warm = [BenchRequest([(t + 1) % 10001 for t in r.prompt], 8) for r in requests[:16]]
        run_workload(url, None, warm, float("inf"), None, 0, TEMPERATURE, None)
        before = scrape(url)
        summary = run_workload(url, None, requests, float("inf"), None, 0, TEMPERATURE, None)
        after = scrape(url)
    finally:
        server.terminate()
        server.wait(60)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    tokens = summary["total_output_tokens"]
    frontend_cpu = delta["process_cpu_seconds_total"]  # the server's process: with the loop's thread, less it
    if not engine_process:
        frontend_cpu -= delta["nanovllm:step_loop_cpu_seconds_total"]
    return {
        "wall_s": summary["duration"],
        "step_s": delta["nanovllm:step_loop_busy_seconds_total"],
        "steps": delta["nanovllm:step_loop_steps_total"],
        "loop_cpu_s": delta["nanovllm:step_loop_cpu_seconds_total"],
        "frontend_cpu_s": frontend_cpu,
        "frontend_cpu_us_per_token": 1e6 * frontend_cpu / tokens,
        "tokens": tokens,
        "tok_per_s": summary["output_throughput"],
    }


def scrape(url: str) -> dict[str, float]:
    """The server's unlabelled or single-series metrics, by name."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--num-seqs", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt and output (nano-vllm's lengths)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (leave a core to the HTTP client)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = str(random_checkpoint(args.shape, torch.bfloat16 if device.type == "cuda" else torch.float32))
    prompts, max_tokens = workload(args.num_seqs, args.max_len, args.max_len)
    # no prefix cache: every run (and mode) computes every prompt, as the first run does
    llm = LLM(model, max_model_len=4096, max_num_seqs=256, enable_prefix_caching=False)
    warm = [[(t + 1) % 10001 for t in p] for p in prompts[:16]]
    llm.generate(warm, SamplingParams(temperature=TEMPERATURE, max_tokens=8, ignore_eos=True), use_tqdm=False)
    results: dict[str, list[dict[str, Any]]] = {"offline": [], "async": [], "http": [], "http-process": []}
    for _ in range(args.repeats):
        results["offline"].append(offline(llm, prompts, max_tokens))
        results["async"].append(asyncio.run(through_async_llm(llm, prompts, max_tokens)))
    if not args.skip_http:
        for _ in range(args.repeats):
            results["http"].append(through_http(model, args, prompts, max_tokens, engine_process=False))
            results["http-process"].append(through_http(model, args, prompts, max_tokens, engine_process=True))
    best = {mode: max(runs, key=lambda r: r["tok_per_s"]) for mode, runs in results.items() if runs}
    for mode, runs in results.items():
        for r in runs:
            extra = f", in step() {r['step_s']:.2f} s" if "step_s" in r else ""
            if "frontend_cpu_s" in r:
                extra += (
                    f" over {r['steps']:.0f} steps; step-loop thread CPU {r['loop_cpu_s']:.2f} s, front-end CPU "
                    f"{r['frontend_cpu_s']:.2f} s = {r['frontend_cpu_us_per_token']:.0f} us per output token"
                )
            print(f"{mode:8s} {r['tokens']} tokens in {r['wall_s']:.2f} s: {r['tok_per_s']:,.0f} tok/s{extra}")
    base = best["offline"]["tok_per_s"]
    for mode, r in best.items():
        print(f"best {mode:8s} {r['tok_per_s']:,.0f} tok/s = {100 * r['tok_per_s'] / base:.1f}% of offline")
    print(json.dumps({"device": str(device), "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
