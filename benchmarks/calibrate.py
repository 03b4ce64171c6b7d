"""A step-time calibration for ``nanovllm simulate``, from the ``nanovllm bench`` runs that cover its step kinds.

    python benchmarks/calibrate.py                                  # 0.6B, bf16 KV cache, on this GPU
    python benchmarks/calibrate.py --shape qwen3-8b --kv-cache-dtype fp8
    python benchmarks/calibrate.py --shape qwen3-8b --kv-cache-dtype fp8 --quantization fp8   # FP8 weights too
    python benchmarks/calibrate.py --dry-run                        # the commands, nothing run
    python benchmarks/calibrate.py --from-servers                   # from three servers' own steps instead

One ``nanovllm bench --json`` run per step kind the simulated policies produce (random weights of the shape,
one run each, every step's GPU time recorded), then ``nanovllm simulate --calibrate`` over all of them:

- ``nano``: nano-vllm's workload (256 sequences, 100-1,024 tokens in and out): decode steps of up to 256
  sequences, and prefills of 14-16k tokens (above the CUDA graphs: eager).
- ``4k``: prompts of up to 4,096 tokens in steps of at most 4,096: prefills on both sides of the graphs' limit.
- ``long-2k``: 16 prompts of up to 32,768 tokens in 2,048-token steps, as ``mixed`` and ``priority`` serve long
  documents: chunks deep into long prompts, whose attention reads every token before them.
- ``long-16k``: the same prompts in the default 16,384-token steps, as ``fifo`` serves them.

``--from-servers`` fits the steps servers ran instead (how the shipped 0.6B bf16 default was made):
``benchmarks/policies.py`` serves the long-documents workload (chat turns, every 20th a document of 8k-32k
tokens) under ``fifo``, ``mixed`` and ``priority`` at 70% and 90% of saturation, each server recording its
steps (``--step-records``) and its requests' timelines (``--request-timelines``), and the calibration is fitted
on the three servers' records: decode batches of every size, short prompts beside decodes, 2,048-token chunks deep
into documents and 16k-token prompt steps, and the front-end's part of each request (unless ``--frontend-metrics``
names scrapes to take it from instead). Then one more server, idle, answers ``request_timeline.py --json``
(prompts of 20,000 and 200 tokens, then 10,000 and 1,000, one at a time): the client's part of a first token's
time, outside the server, and the pipe to the engine process where no step is running to wait for (under load
the hop's stamps hold that wait, which the simulated engine adds itself); the first of them also measures the
front-end's CPU a request and a streamed token (``--cpu-requests``), which the simulator queues. It never takes a
held-out workload of ``policies.py`` (``held-out-agents``, ``held-out-reasoning``, ``held-out-classify``,
``held-out-extract``, ``held-out-rag``: fitted on nothing): it refuses one.

Results go to RESULTS_DIR/calibrate/: NAME.json and NAME.log per run, and the calibration (``--out``, default
RESULTS_DIR/calibrate/CALIBRATION.json), which records the GPU, commit, date and its fit per source run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import (
    Server,
    add_common_arguments,
    add_selection_argument,
    add_server_arguments,
    check_cli,
    machine,
    nanovllm,
    out_dir,
    random_checkpoint,
    read_json,
    run,
    serve_command,
    shown,
    split_list,
)
from policies import refuse_held_out

LONG = ["--num-seqs", "16", "--max-input-len", "32768", "--max-output-len", "256", "--max-model-len", "33024"]
RUNS: dict[str, list[str]] = {  # nanovllm bench flags of each run
    "nano": [],
    "4k": ["--max-input-len", "4096", "--max-num-batched-tokens", "4096"],
    "long-2k": [*LONG, "--max-num-batched-tokens", "2048"],
    "long-16k": LONG,
}


def bench_command(name: str, args: argparse.Namespace, folder: Path) -> list[str]:
    return nanovllm(
        "bench", "--shape", args.shape, "--attention", "triton", "--kv-cache-dtype", args.kv_cache_dtype,
        *(["--quantization", args.quantization] if args.quantization else []),
        "--runs", "1", "--no-progress", *RUNS[name], "--json", str(folder / f"{name}.json"),
    )  # fmt: skip


SERVED_POLICIES = ("fifo", "mixed", "priority")
SERVED_WORKLOADS = ("long-docs",)  # never a held-out one: servers_command refuses it


def servers_command(args: argparse.Namespace) -> list[str]:
    """``policies.py`` serving the long-documents workload under every shipped policy, each server's steps recorded."""
    refuse_held_out(list(SERVED_WORKLOADS), "calibrate.py --from-servers")
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "policies.py")]
    cmd += ["--workloads", ",".join(SERVED_WORKLOADS)]
    cmd += ["--loads", "0.7,0.9", "--policies", ",".join(SERVED_POLICIES), "--idle-prompts", "0", "--step-records"]
    cmd += ["--request-timelines"]  # the front-end's part of each request, fitted beside the steps
    cmd += ["--shape", args.shape, "--results-dir", args.results_dir]
    return cmd + (["--engine-args", f"--kv-cache-dtype {args.kv_cache_dtype}"] if args.kv_cache_dtype != "auto" else [])


IDLE_PROMPTS = ((20000, 200), (10000, 1000))  # the long and short prompts of each request_timeline.py run
CPU_PROBE = ["--cpu-requests", "256"]  # the first run also measures the front-end's CPU a request and a token
IDLE_MAX_MODEL_LEN = 32768


def idle_commands(args: argparse.Namespace, folder: Path) -> tuple[list[str], list[tuple[Path, list[str]]]]:
    """The idle server (writing its requests' timeline) and the ``request_timeline.py --json`` runs against it:
    the client's part of a first token's time, the pipe to the engine with no step to wait for, and the front-end's
    CPU a request and a streamed token."""
    timeline = str(folder / "idle_timeline.jsonl")
    flags = ["--attention", "triton", "--request-timeline", timeline]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    checkpoint = str(random_checkpoint(args.shape, args.dry_run))
    server = serve_command(checkpoint, args.port, IDLE_MAX_MODEL_LEN, *flags)
    script = str(Path(__file__).resolve().parent / "request_timeline.py")
    clients = []
    for i, (long, short) in enumerate(IDLE_PROMPTS):
        out = folder / f"idle_{long}_{short}.json"
        cmd = [sys.executable, script, "--port", str(args.port), "--timeline", timeline, *(CPU_PROBE if i == 0 else [])]
        clients.append((out, [*cmd, "--long", str(long), "--short", str(short), "--runs", "3", "--json", str(out)]))
    return server, clients


def measure_idle(args: argparse.Namespace, folder: Path) -> None:
    server, clients = idle_commands(args, folder)
    with Server(server, folder / "idle_server.log", args.port, args.start_timeout):
        for out, cmd in clients:
            if run(cmd, out.with_suffix(".log")) != 0:
                raise SystemExit(f"error: {shown(cmd)} failed: see {out.with_suffix('.log')}")


def check_served(steps: Path) -> None:
    """The steps folder's servers (its ``policies.py`` summary) served no held-out workload; a one-line error if so."""
    summary = read_json(steps / "summary.json") if (steps / "summary.json").is_file() else {"rows": []}
    refuse_held_out([r["workload"] for r in summary["rows"]], f"calibrate.py --from-servers on {steps}")


def calibrate_command(
    sources: list[Path], out: Path, frontend: list[str], timelines: list[Path] = (), idle: list[Path] = ()
) -> list[str]:
    cmd = nanovllm("simulate", "--calibrate", *(str(p) for p in sources), "--out", str(out))
    cmd += ["--client-timings", *(str(p) for p in idle)] if idle else []
    if frontend:
        return cmd + ["--frontend-metrics", *frontend]
    return cmd + (["--request-timelines", *(str(p) for p in timelines)] if timelines else [])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run the nanovllm bench workloads a simulator calibration needs, then fit it.",
        epilog=f"runs: {', '.join(RUNS)}",
    )
    parser.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", help="the weights' quantization method, e.g. fp8 (nanovllm-quant-fp8)")
    add_selection_argument(parser, "--runs", RUNS)
    parser.add_argument(
        "--from-servers",
        action="store_true",
        help="fit the steps of fifo, mixed and priority servers on the long-documents workload (policies.py) "
        "instead of the bench runs",
    )
    parser.add_argument("--out", help="the calibration file (default: RESULTS_DIR/calibrate/CALIBRATION.json)")
    parser.add_argument(
        "--frontend-metrics",
        nargs="+",
        default=[],
        metavar="METRICS_TXT",
        help="a nanovllm serve /metrics scrape (and an earlier one of the same server): the front-end constants",
    )
    add_common_arguments(parser)
    add_server_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = split_list(args.runs, RUNS, "--runs")
    folder = out_dir(args.results_dir, "calibrate", make=not args.dry_run)
    kv = "bf16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    weights = f"-{args.quantization}-weights" if args.quantization else ""
    out = Path(args.out) if args.out else folder / f"{args.shape}-{kv}{weights}.json"
    if args.from_servers:
        commands = [("servers", servers_command(args))]
        steps = out_dir(args.results_dir, "policies", make=False)
        idle_server, idle_clients = idle_commands(args, folder)
        final = calibrate_command(
            [steps / f"steps_{p}.json" for p in SERVED_POLICIES],
            out,
            args.frontend_metrics,
            [steps / f"timeline_{p}.jsonl" for p in SERVED_POLICIES],
            [json_out for json_out, _ in idle_clients],
        )
    else:
        commands = [(n, bench_command(n, args, folder)) for n in names]
        final = calibrate_command([folder / f"{n}.json" for n in names], out, args.frontend_metrics)
        for _, cmd in commands:
            check_cli(cmd)
    check_cli(final)
    if args.dry_run:
        for _, cmd in commands:
            print(shown(cmd))
        if args.from_servers:
            print(f"{shown(idle_server)} &")
            for _, cmd in idle_clients:
                print(shown(cmd))
            print("(stop the server: SIGTERM)")
        print(shown(final))
        return 0
    print(f"# {machine()}")
    for name, cmd in commands:
        if run(cmd, folder / f"{name}.log") != 0:
            raise SystemExit(f"error: the {name} run failed: see {folder / f'{name}.log'}")
    if args.from_servers:
        check_served(steps)
        measure_idle(args, folder)
    return run(final, folder / "calibrate.log")


if __name__ == "__main__":
    sys.exit(main())
