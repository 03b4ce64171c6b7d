"""Simulate what ``benchmarks/policies.py`` measured, cell by cell: the simulator checked against a GPU.

    python benchmarks/policies.py --workloads sharegpt-synth --loads 0.3,0.5,0.7,0.9    # on the GPU
    python benchmarks/simulate_policies.py --results-dir results                          # anywhere, no GPU

For every policy, workload and load in RESULTS_DIR/policies/ (``POLICY_WORKLOAD.json`` and ``summary.json``, as
``policies.py`` writes them), one ``nanovllm simulate`` of the same workload, arrivals (client processes, seed,
priority classes), step size and ``--max-model-len``, with the prefix cache as that server had it: warm for every
run after the first of a workload on a server, and for the first policy's loads, which follow its all-at-once
run. Prints a table row per run, **simulated / measured (difference)** for request throughput and TTFT and ITL
at p50 and p99, and how many cells are within the goal (throughput and p50s within 10%, p99s within 20%): over
all runs, and apart for a held-out workload (``held-out-agents``: fitted on nothing), reported as it comes. Then
the policies' order on each p99: for every two policies run at one workload and rate whose measured p99s differ
by more than 10%, whether the simulated ones are in the same order (a simulated tie is not).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import add_common_arguments, read_json, run_cli_in_process, write_json
from policies import HELD_OUT, MAX_MODEL_LEN, WORKLOADS, trace_file

METRICS = (("request_throughput", 10), ("median_ttft_ms", 10), ("p99_ttft_ms", 20), ("median_itl_ms", 10),
           ("p99_itl_ms", 20))  # fmt: skip


def measured_runs(folder: Path, policy: str, workload: str) -> list[dict[str, Any]]:
    path = folder / f"{policy}_{workload}.json"
    if not path.is_file():
        return []
    data = read_json(path)
    return data.get("runs", [data])


def simulate_command(
    folder: Path, summary: dict[str, Any], policy: str, workload: str, run: dict[str, Any], warm: bool, args: Any
) -> list[str]:
    workloads = sorted({r["workload"] for r in summary["rows"]})
    max_model_len = max(WORKLOADS[w].get("max_model_len", MAX_MODEL_LEN) for w in workloads if w in WORKLOADS)
    return workload_command(
        workload,
        trace_file(folder, workload),
        run.get("num_prompts", WORKLOADS[workload]["prompts"]),
        run["request_rate"],
        max_model_len,
        None if policy == "fifo" else policy,
        summary["step_tokens"],
        args.client_processes,
        args.calibration,
        warm,
        summary.get("cuda_graph_max_mixed_tokens"),  # runs before it was recorded: the calibration's own
    )


def workload_command(
    workload: str,
    trace: Path | None,
    num_prompts: int,
    rate: float,
    max_model_len: int,
    scheduler: str | None,
    step_tokens: int,
    client_processes: int,
    calibration: str | None,
    warm: bool = False,
    graph_limit: int | None = None,
) -> list[str]:
    """``nanovllm simulate`` of a ``policies.py`` workload as its servers ran it: two priority classes, ``fifo``
    (``scheduler`` None) with its default steps, any other policy with ``step_tokens`` steps; ``warm``: the
    workload's prompts already in the prefix cache. ``trace``: the trace file of a trace workload (``TRACE`` in
    its flags); ``graph_limit``: the servers' ``cuda_graph_max_mixed_tokens`` (None: the calibration's)."""
    flags = [str(trace) if f == "TRACE" else f for f in WORKLOADS[workload]["flags"]]
    cmd = ["simulate", *flags, "--num-prompts", str(num_prompts)]
    cmd += ["--max-model-len", str(max_model_len), "--client-processes", str(client_processes)]
    cmd += ["--priorities", "0,1", "--request-rate", f"{rate:g}"]
    if scheduler is not None:
        cmd += ["--scheduler", scheduler, "--max-num-batched-tokens", str(step_tokens)]
    if warm:
        cmd += ["--warm-prefix-cache", str(num_prompts)]
    if calibration:
        cmd += ["--calibration", calibration]
    if graph_limit is not None:
        cmd += ["--cuda-graph-max-mixed-tokens", str(graph_limit)]
    return cmd


def simulate(cmd: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "simulated.json"
        run_cli_in_process([*cmd, "--result-file", str(result)])
        return read_json(result)


ORDERED = ("p99_ttft_ms", "p99_itl_ms")  # the tails whose order among the policies the simulator must keep
ORDER_MARGIN = 1.10  # two measured figures further apart than this are an order to keep


def policy_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per pair of policies run at one workload and rate, per :data:`ORDERED` tail, where the measured
    figures differ by more than :data:`ORDER_MARGIN`: the two policies, the lower measured first, and whether the
    simulated figures put them in the same strict order."""
    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if (a["workload"], a["request_rate"]) != (b["workload"], b["request_rate"]) or a["policy"] == b["policy"]:
                continue
            for metric in ORDERED:
                low, high = sorted((a, b), key=lambda r: r["measured"][metric])
                if high["measured"][metric] <= ORDER_MARGIN * low["measured"][metric]:
                    continue
                pairs.append({"workload": a["workload"], "request_rate": a["request_rate"], "metric": metric,
                              "lower": low["policy"], "higher": high["policy"],
                              "same": low["simulated"][metric] < high["simulated"][metric]})  # fmt: skip
    return pairs


def cell(simulated: float, measured: float, goal: float) -> tuple[str, bool]:
    def shown(v: float) -> str:
        return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"

    diff = 100 * (simulated / measured - 1)
    within = abs(diff) <= goal
    return f"{shown(simulated)} / {shown(measured)} ({diff:+.0f}%{'' if within else ' **miss**'})", within


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Simulate every run benchmarks/policies.py measured (RESULTS_DIR/policies/) and print "
        "simulated / measured rows."
    )
    parser.add_argument("--calibration", help="the simulator's calibration (default: its own default)")
    parser.add_argument("--client-processes", type=int, default=4, help="policies.py's --client-processes (default 4)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    add_common_arguments(parser, dry_run=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.results_dir) / "policies"
    if not (folder / "summary.json").is_file():
        raise SystemExit(f"error: {folder / 'summary.json'} not found: run benchmarks/policies.py first")
    summary = read_json(folder / "summary.json")
    policies = list(dict.fromkeys(r["policy"] for r in summary["rows"]))
    workloads = list(dict.fromkeys(r["workload"] for r in summary["rows"]))
    saturation = summary.get("saturation_req_per_s", {})
    rows, within, total = [], 0, 0
    held = {w: [0, 0] for w in workloads if w in HELD_OUT}  # a held-out workload's cells within the goal, cells
    print("| workload, load | policy | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for i, policy in enumerate(policies):
        for workload in workloads:
            for j, run in enumerate(measured_runs(folder, policy, workload)):
                cmd = simulate_command(folder, summary, policy, workload, run, j > 0 or i == 0, args)
                simulated = simulate(cmd)
                cells = [cell(simulated[k], run[k], goal) for k, goal in METRICS]
                within += sum(ok for _, ok in cells)
                total += len(cells)
                if workload in held:
                    held[workload][0] += sum(ok for _, ok in cells)
                    held[workload][1] += len(cells)
                rate = run["request_rate"]
                known = workload in saturation and rate != float("inf")
                load = f"{100 * rate / saturation[workload]:.0f}%, " if known else ""
                print(f"| {workload}, {load}{rate:g} req/s | `{policy}` | " + " | ".join(c for c, _ in cells) + " |")
                rows.append({"policy": policy, "workload": workload, "held_out": workload in held,
                             "request_rate": rate, "command": "nanovllm " +
                             " ".join(cmd), "simulated": {k: simulated[k] for k, _ in METRICS},
                             "measured": {k: run[k] for k, _ in METRICS}})  # fmt: skip
    print(f"\n{within} of {total} cells within the goal (throughput and p50s within 10%, p99s within 20%)")
    for workload, (ok, cells) in held.items():
        print(f"held out (fitted on nothing): {workload}, {ok} of {cells} cells within the goal")
    order = policy_order(rows)
    apart = f"{100 * (ORDER_MARGIN - 1):.0f}%"
    print(f"the policies' order on each p99 (measured figures more than {apart} apart): the same in "
          f"{sum(p['same'] for p in order)} of {len(order)} pairs")  # fmt: skip
    for p in order:
        if not p["same"]:
            print(f"  not kept: {p['workload']} at {p['request_rate']:g} req/s, {p['metric']}: "
                  f"`{p['lower']}` below `{p['higher']}` measured, not simulated")  # fmt: skip
    if args.json:
        held_out = {w: {"within": ok, "cells": n} for w, (ok, n) in held.items()}
        write_json(Path(args.json), {"rows": rows, "within": within, "cells": total, "held_out": held_out,
                                     "order": order})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
