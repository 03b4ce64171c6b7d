"""Does the simulator's queued front-end predict a real front-end's waits? Measured without a GPU.

The real front-end (AsyncLLM, the FastAPI app, uvicorn) serves, in this process, the scripted engine of
``frontend_capacity.py`` in its own process (steps every ``--step-ms``, one token per running request, no model).
First, idle, ``request_timeline.py`` times its stages one request at a time and measures its CPU a request and a
streamed token (``--cpu-requests``); from those alone comes a calibration: the scripted engine's steps (each
``--step-ms`` whatever its batch, scheduled after the last ends, prompts and decodes together as ``mixed`` does), the
engine process's time between two steps (a request alone's time a token, less the step) and the idle front-end.
Then ``nanovllm bench serve`` sends the random workload at each load (a share of the front-end's capacity by the
idle CPU figures), and ``nanovllm simulate`` replays the same requests and arrivals twice: with the fixed front-end
(the idle times whatever the load) and with the queued one. Nothing measured under load goes into either
calibration.

    python benchmarks/frontend_queue.py [--loads 0.3,0.6,0.8] [--num-prompts 2000] [--step-ms 2]
        [--input-len 256 --output-len 4] [--results-dir results]

Results go to RESULTS_DIR/frontend_queue/: the idle figures, both calibrations, each load's measured and simulated
results and ``summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from frontend_capacity import free_port
from nanovllm_testing.scripted import build_scripted_engine

from nanovllm_core.gc_heap import GCPauses, freeze_startup_heap

HERE = Path(__file__).resolve().parent
METRICS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


async def run(cmd: list[str], log: Path) -> None:
    with log.open("w") as out:
        process = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out)
        if await process.wait() != 0:
            raise SystemExit(f"error: {' '.join(cmd)} failed: see {log}")


def workload_args(args: argparse.Namespace, rate: float) -> list[str]:
    """The same requests and arrivals for bench serve and simulate."""
    return ["--dataset", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
            "--request-rate", f"{rate:.1f}", "--seed", "0"]  # fmt: skip


async def measure(
    args: argparse.Namespace, model: str, vocab: int, folder: Path, gc_pauses: dict[float, dict[str, float]]
) -> tuple[dict, list[float], float]:
    """The idle figures, then bench serve at each load; returns the idle figures, the rates and this process's
    CPU seconds (the front-end's) as the loads began; each load's front-end collections go into ``gc_pauses``."""
    import uvicorn

    from nanovllm_core.engine_client.step_loop import EngineProcess
    from nanovllm_core.serving.api_server import ServerSettings, build_app
    from nanovllm_core.serving.async_llm import AsyncLLM

    build = functools.partial(build_scripted_engine, model, args.step_ms / 1000, args.max_num_seqs)
    engine = AsyncLLM(EngineProcess(build=build))
    timeline = folder / "timeline.jsonl"
    settings = ServerSettings(served_model_name="scripted", request_timeline=str(timeline))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, settings), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    freeze_startup_heap()  # as `nanovllm serve` does once it is up
    try:
        idle = folder / "idle.json"
        probe = ["--cpu-requests", str(args.probe_requests), "--cpu-output-tokens", "16"]
        await run([sys.executable, str(HERE / "request_timeline.py"), "--port", str(port), "--timeline", str(timeline),
                   "--long", str(4 * args.input_len), "--short", str(args.input_len), "--runs", "5",
                   "--max-token-id", str(vocab), *probe, "--json", str(idle)], folder / "idle.log")  # fmt: skip
        cpu = json.loads(idle.read_text())["frontend_cpu"]
        request_ms = cpu["ms_per_request"] + (args.output_len - 1) * cpu["ms_per_output_token"]
        rates = [load * 1e3 / request_ms for load in args.loads]
        cpu_start = time.process_time()
        for load, rate in zip(args.loads, rates):
            result = folder / f"measured_{load}.json"
            client = [sys.executable, "-m", "nanovllm_core.cli", "bench", "serve", "--base-url",
                      f"http://127.0.0.1:{port}", *workload_args(args, rate), "--warmup", "0", "--temperature", "0",
                      "--server-metrics", "--result-file", str(result)]  # fmt: skip
            with GCPauses() as pauses:  # the front-end's collections (it runs in this process): its loop stands
                await run(client, result.with_suffix(".log"))
            gc_pauses[load] = {"collections": sum(pauses.collections), "longest_ms": 1e3 * pauses.longest_s,
                               "total_ms": 1e3 * sum(pauses.seconds)}  # fmt: skip
    finally:
        server.should_exit = True
        await serving
    return json.loads(idle.read_text()), rates, cpu_start


def engine_gap_ms(idle: dict, step_ms: float) -> float:
    """The engine process's own time between two steps (its loop, the outputs' message), on top of the scripted
    step: a request alone's time from one token to the next, less the step."""
    cycle = idle["frontend_cpu"]["alone"]["ms_per_step"]
    return max(0.0, cycle - step_ms) if cycle is not None else 0.0


def calibrations(args: argparse.Namespace, idle: Path, folder: Path) -> dict[str, Path]:
    """The scripted engine's steps and the idle front-end: with its CPU costs (queued) and without (fixed)."""
    from nanovllm_bench.simulate import Calibration
    from nanovllm_bench.simulate.cost import FEATURES, FRONTEND_CPU_KEYS, client_from_timings, frontend_from_idle

    frontend = {**frontend_from_idle([str(idle)]), **client_from_timings([str(idle)])}
    fixed = {k: v for k, v in frontend.items() if k not in FRONTEND_CPU_KEYS}
    host_gap = engine_gap_ms(json.loads(idle.read_text()), args.step_ms)
    paths = {}
    for name, front in (("fixed", fixed), ("queued", frontend)):
        cal = Calibration(
            coefficients_ms={**dict.fromkeys(FEATURES, 0.0), "fixed": args.step_ms, "per_prompt_pair": 0.0},
            gpu="none (scripted engine)", model="scripted", num_kvcache_blocks=65536, host_gap_ms=host_gap,
            frontend=front, notes=f"frontend_queue.py: steps of {args.step_ms} ms and the engine's gap between two "
            f"steps, the front-end, both from {idle.name}",
        )  # fmt: skip
        paths[name] = folder / f"calibration_{name}.json"
        paths[name].write_text(cal.to_json())
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loads", default="0.3,0.6,0.8", help="shares of the front-end's idle-measured capacity")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=4, help="output tokens of every request")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the scripted engine's step time")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--probe-requests", type=int, default=256, help="requests of each idle CPU burst")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args(argv)
    args.loads = [float(x) for x in args.loads.split(",")]
    import torch
    from _common import out_dir, run_cli_in_process, write_json
    from nanovllm_bench.offline import random_checkpoint

    model = random_checkpoint("tiny", torch.float32)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    folder = out_dir(args.results_dir, "frontend_queue")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    gc_pauses: dict[float, dict[str, float]] = {}
    idle, rates, cpu_before = asyncio.run(measure(args, str(model), vocab, folder, gc_pauses))
    cals = calibrations(args, folder / "idle.json", folder)
    rows: list[dict[str, Any]] = []
    for load, rate in zip(args.loads, rates):
        row: dict[str, Any] = {"load": load, "rate": rate}
        row["measured"] = json.loads((folder / f"measured_{load}.json").read_text())
        # the front-end's CPU a request under this load (a reading beside the idle figure, never fitted)
        cpu_after = row["measured"]["server_metrics"]["process_cpu_seconds_total"]
        row["cpu_ms_per_request_under_load"] = 1e3 * (cpu_after - cpu_before) / row["measured"]["completed"]
        cpu_before = cpu_after
        row["frontend_gc"] = gc_pauses[load]
        for name, cal in cals.items():
            out = folder / f"simulated_{name}_{load}.json"
            sim = ["--calibration", str(cal), *workload_args(args, rate), "--max-num-seqs", str(args.max_num_seqs),
                   "--no-async-scheduling", "--scheduler", "mixed", "--result-file", str(out)]  # fmt: skip
            run_cli_in_process(["simulate", *sim], out.with_suffix(".log"))
            row[name] = json.loads(out.read_text())
        rows.append(row)
    cpu = idle["frontend_cpu"]
    gap = engine_gap_ms(idle, args.step_ms)
    print(f"front-end CPU, idle: {cpu['ms_per_request']:.3f} ms a request, {cpu['ms_per_output_token']:.4f} ms each "
          f"further token, {cpu.get('ms_per_step', 0.0):.4f} ms a step's outputs; steps of {args.step_ms} ms and "
          f"{gap:.3f} ms between two; measured / simulated fixed / simulated queued:")  # fmt: skip
    for row in rows:
        cells = ", ".join(
            f"{m} {row['measured'][m]:.1f} / {row['fixed'][m]:.1f} / {row['queued'][m]:.1f}" for m in METRICS
        )
        busy = row["queued"]["simulated"].get("frontend_busy_fraction") or 0.0
        gc = row["frontend_gc"]
        print(f"{row['load']:.0%} ({row['rate']:.0f} req/s, simulated front-end busy {busy:.0%}, measured front-end "
              f"CPU {row['cpu_ms_per_request_under_load']:.3f} ms a request, {gc['collections']} collections of "
              f"{gc['total_ms']:.1f} ms in all): {cells}")  # fmt: skip
    write_json(folder / "summary.json", {"args": vars(args), "idle": idle, "rows": [
        {"load": r["load"], "rate": r["rate"], "cpu_ms_per_request_under_load": r["cpu_ms_per_request_under_load"],
         "frontend_gc": r["frontend_gc"],
         **{k: {m: r[k][m] for m in METRICS} for k in ("measured", *cals)}}
        for r in rows
    ]})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
