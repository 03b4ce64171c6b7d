"""The server against the offline engine, and its latency against request rate.

    python benchmarks/serving.py                                   # Qwen3-0.6B shape, fifo
    python benchmarks/serving.py --shape qwen3-8b --rates 10,20,30
    python benchmarks/serving.py --dry-run                         # the commands, nothing run

In turn, on one GPU:

1. offline: ``nanovllm bench`` on nano-vllm's workload, the reference (``--no-offline`` skips it);
2. ``nanovllm serve`` on 127.0.0.1 with the random-weight checkpoint of ``--shape`` (the one ``nanovllm bench``
   writes), ready once ``/health`` answers;
3. all at once: ``nanovllm bench serve --dataset nano --request-rate inf``, the same 256 requests as the offline
   run: output tok/s through the server over offline gives the serving overhead;
4. saturation: ``--saturation-prompts`` sharegpt-synth requests at once; their request rate is the server's
   capacity;
5. latency against rate: ``--num-prompts`` sharegpt-synth requests at each of ``--rates`` (default: 30, 50, 70
   and 90% of that capacity), Poisson arrivals, from ``--client-processes`` client processes;
6. the server stopped with SIGTERM (its own graceful stop).

Results go to RESULTS_DIR/serving/: offline.json, all_at_once.json, saturation.json, rates.json (what
``nanovllm bench serve --result-file`` writes), the server's /metrics after each run, every log, and
summary.json with the GPU, date and commit; the script ends with table rows in docs/performance.md's format.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from _common import (
    Server,
    add_client_processes_argument,
    add_common_arguments,
    add_server_arguments,
    bench_serve_command,
    check_cli,
    machine,
    markdown_row,
    nanovllm,
    out_dir,
    parse_numbers,
    random_checkpoint,
    read_json,
    require_positive,
    run,
    serve_command,
    shown,
    user_command,
    write_json,
)

RATES_PLACEHOLDER = "RATES"  # a dry run cannot know the rates measured from saturation


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--attention", args.attention]
    if args.scheduler != "fifo":
        flags += ["--scheduler", args.scheduler, "--max-num-batched-tokens", str(args.step_tokens)]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    return flags + shlex.split(args.engine_args)


def plan(args: argparse.Namespace, folder: Path, checkpoint: str) -> dict[str, list[str]]:
    """Every command the run makes, by name, in order (the rate sweep's rates as given or as a placeholder)."""
    port, processes = args.port, args.client_processes
    commands: dict[str, list[str]] = {}
    if args.offline:
        commands["offline"] = nanovllm(
            "bench",
            "--shape",
            args.shape,
            *engine_flags(args),
            "--runs",
            "2",
            "--warmup-prompts",
            "1",
            "--json",
            str(folder / "offline.json"),
        )
    commands["server"] = serve_command(checkpoint, port, 4096, *engine_flags(args))
    commands["all_at_once"] = bench_serve_command(
        port, folder / "all_at_once.json", "--dataset", "nano", "--request-rate", "inf", processes=processes
    )
    sharegpt = ["--dataset", "sharegpt-synth", "--num-prompts"]
    if not args.rates:
        commands["saturation"] = bench_serve_command(
            port, folder / "saturation.json", *sharegpt, str(args.saturation_prompts), "--request-rate", "inf",
            processes=processes,
        )  # fmt: skip
    commands["rates"] = bench_serve_command(
        port, folder / "rates.json", *sharegpt, str(args.num_prompts), "--rates", args.rates or RATES_PLACEHOLDER,
        processes=processes,
    )  # fmt: skip
    return commands


def summarize(args: argparse.Namespace, folder: Path, cmd: str) -> dict[str, Any]:
    summary: dict[str, Any] = {"shape": args.shape, "scheduler": args.scheduler, "command": cmd, **machine()}
    burst = read_json(folder / "all_at_once.json")
    summary["all_at_once"] = {
        k: burst[k]
        for k in (
            "output_throughput",
            "request_throughput",
            "median_ttft_ms",
            "p99_ttft_ms",
            "median_tpot_ms",
            "completed",
            "failed",
        )
    }
    if (folder / "offline.json").is_file():
        offline = read_json(folder / "offline.json")
        summary["offline_tok_per_s"] = offline["output_tok_per_s"]
        summary["serve_over_offline"] = burst["output_throughput"] / offline["output_tok_per_s"]
    if (folder / "saturation.json").is_file():
        summary["saturation_req_per_s"] = read_json(folder / "saturation.json")["request_throughput"]
    rates = read_json(folder / "rates.json")
    keys = (
        "request_rate",
        "request_throughput",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_tpot_ms",
        "completed",
        "failed",
    )
    summary["rates"] = [{k: r.get(k) for k in keys} for r in rates.get("runs", [rates])]
    return summary


def print_rows(summary: dict[str, Any]) -> None:
    tail = [f"`{summary['command']}`", summary["gpu"], summary["date"], summary["commit"]]
    burst = summary["all_at_once"]
    print(
        "\nRows for docs/performance.md, all at once (workload | through the server | offline | server/offline | "
        "TTFT p50 / p99 ms | command | GPU | date | commit):"
    )
    offline = summary.get("offline_tok_per_s")
    print(
        markdown_row(
            [
                f"{summary['shape']}, nano-vllm's 256 requests at once",
                f"{burst['output_throughput']:,.0f}",
                f"{offline:,.0f}" if offline else "",
                f"{100 * summary['serve_over_offline']:.1f}%" if offline else "",
                f"{burst['median_ttft_ms']:,.0f} / {burst['p99_ttft_ms']:,.0f}",
                *tail,
            ]
        )
    )
    print(
        "\nLatency against rate (request rate | TTFT p50 / p99 ms | ITL p50 / p99 ms | command | GPU | date | commit; "
        "summary.json also has TPOT and throughput):"
    )
    for r in summary["rates"]:
        print(
            markdown_row(
                [
                    f"{r['request_rate']:g} req/s",
                    f"{r['median_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f}",
                    f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f}",
                    *tail,
                ]
            )
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="`nanovllm serve` against offline `nanovllm bench` (nano-vllm's workload all at once), then "
        "latency against request rate; results in RESULTS_DIR/serving/."
    )
    parser.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default qwen3-0.6b)")
    parser.add_argument("--scheduler", default="fifo", help="scheduler policy (default fifo)")
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=2048,
        help="--max-num-batched-tokens for a policy other than fifo (default 2048: every step "
        "with prompt tokens stays within the CUDA graphs)",
    )
    parser.add_argument("--attention", default="triton")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--engine-args",
        default="",
        metavar="FLAGS",
        help="more engine flags for the server and the offline run, one quoted string",
    )
    add_server_arguments(parser)
    parser.add_argument("--rates", help="comma-separated request rates (default: --rate-fractions of saturation)")
    parser.add_argument(
        "--rate-fractions",
        default="0.3,0.5,0.7,0.9",
        help="fractions of the measured saturation rate (default 0.3,0.5,0.7,0.9)",
    )
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per rate (default 1000)")
    parser.add_argument("--saturation-prompts", type=int, default=1000, help="requests sent at once (default 1000)")
    add_client_processes_argument(parser)
    parser.add_argument("--no-offline", dest="offline", action="store_false", help="skip the offline reference")
    add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.rates:
        parse_numbers(args.rates, "--rates")
    fractions = parse_numbers(args.rate_fractions, "--rate-fractions")
    require_positive(args, "num_prompts", "saturation_prompts", "client_processes", "step_tokens")
    folder = out_dir(args.results_dir, "serving", make=not args.dry_run)
    checkpoint = str(random_checkpoint(args.shape, args.dry_run))
    commands = plan(args, folder, checkpoint)
    for name, cmd in commands.items():
        check_cli(cmd)
        if args.dry_run:
            print(shown(cmd) + (" &" if name == "server" else ""))
    if args.dry_run:
        if not args.rates:
            print(f"({RATES_PLACEHOLDER}: {args.rate_fractions} of the saturation run's request rate)")
        return 0
    failed = []
    if args.offline and run(commands["offline"], folder / "offline.log") != 0:
        failed.append("offline")
    with Server(commands["server"], folder / "server.log", args.port, args.start_timeout) as server:
        for name in ("all_at_once", "saturation", "rates"):
            if name not in commands:
                continue
            cmd = commands[name]
            if name == "rates" and not args.rates:
                if not (folder / "saturation.json").is_file():
                    failed.append(name)
                    continue
                capacity = read_json(folder / "saturation.json")["request_throughput"]
                rates = ",".join(f"{f * capacity:.1f}" for f in fractions)
                cmd = [rates if c == RATES_PLACEHOLDER else c for c in cmd]
            if run(cmd, folder / f"{name}.log") != 0:
                failed.append(name)
            (folder / f"metrics_{name}.txt").write_text(server.metrics())
    if "all_at_once" in failed or "rates" in failed:
        print(f"failed: {', '.join(failed)} (see their logs in {folder})", file=sys.stderr)
        return 1
    summary = summarize(args, folder, user_command("benchmarks/serving.py", argv))
    write_json(folder / "summary.json", summary)
    print_rows(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
