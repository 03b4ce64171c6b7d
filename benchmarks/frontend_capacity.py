"""How many streamed tokens per second can the server's front-end deliver? Measured without a GPU.

A scripted engine stands in for the model: in its own process (the real ``EngineProcess`` pipe and step loop),
it "runs" each step in ``--step-ms`` (a sleep, as a GPU step leaves the host idle) and then emits one token
per running request, through the same outputs the real engine emits (delta text, token ids, metrics). The
front-end is the real one (AsyncLLM, the FastAPI app, uvicorn) in this process; the client is
``nanovllm bench serve`` in a subprocess, sending the nano-vllm workload all at once. The engine alone would
produce ``running requests / step time`` tokens per second; the result says how much of that reaches the
client, with the front-end's CPU time per token and the time the step loop spent handing outputs over.

    python benchmarks/frontend_capacity.py [--num-prompts 256] [--step-ms 5] [--shape tiny] [--json PATH]

Set ``--step-ms`` to the decode step time of the model and GPU you care about (``nanovllm bench`` reports its
decode steps): the front-end keeps up when nearly all of the engine's rate reaches the client. Without ``--json``
the result goes to RESULTS_DIR/frontend_capacity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nanovllm_testing.scripted import build_scripted_engine

from nanovllm_core.gc_heap import GCPauses, freeze_startup_heap


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def serve_and_measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import functools

    import uvicorn

    from nanovllm_core.engine_client.step_loop import EngineProcess
    from nanovllm_core.serving.api_server import ServerSettings, build_app
    from nanovllm_core.serving.async_llm import AsyncLLM

    build = functools.partial(build_scripted_engine, model, args.step_ms / 1000, args.max_num_seqs)
    core = EngineProcess(build=build)
    if args.reader_thread:  # the previous design: a thread reads the pipe and posts to the event loop
        from nanovllm_core.engine_client.step_loop import on_loop

        start = core.start
        core.start = lambda emit, fail, loop: start(on_loop(loop, emit), on_loop(loop, fail))  # type: ignore[method-assign]
    engine = AsyncLLM(core)
    app = build_app(engine, ServerSettings(served_model_name="scripted"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **args.uvicorn))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    result_file = Path(tempfile.mkdtemp()) / "result.json"
    client = [sys.executable] + (["-m", "cProfile", "-o", args.client_profile] if args.client_profile else [])
    client += ["-m", "nanovllm_core.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    client += ["--dataset", "nano", "--num-prompts", str(args.num_prompts), "--request-rate", "inf"]
    client += ["--max-input-len", str(args.max_len), "--max-output-len", str(args.max_len), "--warmup", "0"]
    client += ["--result-file", str(result_file), "--client-processes", str(args.client_processes)]
    freeze_startup_heap()  # as `nanovllm serve` does once it is up
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    account_before = engine.account
    with GCPauses() as pauses:
        process = await asyncio.create_subprocess_exec(*client, stdout=subprocess.DEVNULL)
        await process.wait()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    account = engine.account
    server.should_exit = True
    await serving
    summary = json.loads(result_file.read_text())
    summary = summary[0] if isinstance(summary, list) else summary
    tokens = summary["total_output_tokens"]
    cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    client_cpu = (client_after.ru_utime + client_after.ru_stime) - (client_before.ru_utime + client_before.ru_stime)
    steps = account.steps - account_before.steps
    return {
        "tok_per_s": summary["output_throughput"],
        "duration_s": summary["duration"],
        "tokens": tokens,
        "completed": summary["completed"],
        "steps": steps,
        "engine_alone_tok_per_s": tokens / (steps * args.step_ms / 1000) if steps else 0.0,
        "frontend_cpu_us_per_token": 1e6 * cpu / tokens if tokens else 0.0,
        "client_cpu_us_per_token": 1e6 * client_cpu / tokens if tokens else 0.0,
        "frontend_gc": pauses.summary(),
        "frontend_gc_s": sum(pauses.seconds),
        "emit_ms_per_step": 1000 * (account.emit_seconds - account_before.emit_seconds) / steps if steps else 0.0,
        "median_tpot_ms": summary["median_tpot_ms"],
        "median_ttft_ms": summary["median_ttft_ms"],
        "p99_ttft_ms": summary["p99_ttft_ms"],
        "p99_itl_ms": summary["p99_itl_ms"],
        "client_processes": args.client_processes,
        "mean_client_loop_lag_ms": summary.get("mean_client_loop_lag_ms", 0.0),
        "p99_client_loop_lag_ms": summary.get("p99_client_loop_lag_ms", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (nano-vllm's: 1024)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the scripted engine's step time")
    parser.add_argument("--shape", default="tiny", help="checkpoint whose tokenizer and config the server loads")
    parser.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop of the front-end (auto: uvloop when installed, as uvicorn picks)",
    )
    parser.add_argument("--http", default="auto", help="uvicorn's --http (auto, h11, httptools)")
    parser.add_argument(
        "--reader-thread", action="store_true", help="read the engine's pipe in a thread, not from the event loop"
    )
    parser.add_argument("--profile", help="write a cProfile of the front-end here")
    parser.add_argument("--client-profile", help="write a cProfile of the client (nanovllm bench serve) here")
    parser.add_argument("--client-processes", type=int, default=1, help="bench serve's --client-processes")
    parser.add_argument("--json", help="write the result here (default: in --results-dir)")
    parser.add_argument("--results-dir", default="results", help="without --json: RESULTS_DIR/ (default results)")
    args = parser.parse_args(argv)
    args.uvicorn = {"http": args.http}  # the loop is this process's own (uvicorn serves inside it)
    run = asyncio.run
    if args.loop != "asyncio":
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            if args.loop == "uvloop":
                raise SystemExit("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    import torch
    from _common import out_dir, write_json
    from nanovllm_bench.offline import random_checkpoint

    model = str(random_checkpoint(args.shape, torch.float32))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.profile:  # the front-end's functions by own time (cProfile's numbers run slower than the real ones)
        import cProfile

        with cProfile.Profile() as profile:
            result = run(serve_and_measure(args, model))
        profile.dump_stats(args.profile)
    else:
        result = run(serve_and_measure(args, model))
    result["args"] = {k: v for k, v in vars(args).items() if k != "uvicorn"}
    print(
        f"{result['tokens']} tokens in {result['duration_s']:.2f} s: {result['tok_per_s']:,.0f} tok/s through the "
        f"server, engine alone {result['engine_alone_tok_per_s']:,.0f} tok/s over {result['steps']} steps "
        f"({100 * result['tok_per_s'] / max(result['engine_alone_tok_per_s'], 1):.0f}%); front-end CPU "
        f"{result['frontend_cpu_us_per_token']:.1f} us/token, client (bench serve) CPU "
        f"{result['client_cpu_us_per_token']:.1f} us/token ({args.client_processes} process(es), event loop lag "
        f"mean {result['mean_client_loop_lag_ms']:.2f} ms, p99 {result['p99_client_loop_lag_ms']:.2f} ms); "
        f"engine handing outputs over "
        f"{result['emit_ms_per_step']:.2f} ms/step; TTFT p50 {result['median_ttft_ms']:.0f} ms, p99 "
        f"{result['p99_ttft_ms']:.0f} ms; TPOT p50 {result['median_tpot_ms']:.1f} ms, ITL p99 "
        f"{result['p99_itl_ms']:.1f} ms; front-end garbage collection: {result['frontend_gc']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    else:
        write_json(out_dir(args.results_dir, "") / "frontend_capacity.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
