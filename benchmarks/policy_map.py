"""Where each scheduler policy wins, simulated: docs/evaluating-a-scheduler.md's policy map, no GPU needed.

    python benchmarks/policy_map.py                          # the page's table, with the shipped calibration
    PYTHONPATH=examples/tutorial/nanovllm-scheduler-decode-first python benchmarks/policy_map.py \\
        --extra-policy decode_first=nanovllm_decode_first.scheduler:DecodeFirstScheduler

Every workload of ``benchmarks/policies.py`` at the loads where policies differ, each a fraction of the measured
all-at-once rate (``--saturation`` overrides those), simulated cold under each policy: ``fifo`` with its default
steps, the others with ``--step-tokens`` steps, two priority classes in turn, four client processes. Prints one
markdown row per run: TTFT and ITL p50 / p99 and each class's TTFT p99.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import add_common_arguments, out_dir, write_json
from policies import LONG_DOCS_TRACE, MAX_MODEL_LEN, WORKLOADS, parse_saturation, write_long_documents_trace
from simulate_policies import simulate, workload_command

# fifo's all-at-once request rate on the H200, 0.6B bf16 (docs/evaluating-a-scheduler.md's validation runs;
# long documents after the decode fix of cae3be4)
MEASURED_SATURATION = {"sharegpt-synth": 163.5, "nano": 49.0, "long-prompts": 31.5, "long-docs": 47.2}
# (workload, fraction of saturation, policies); None: every policy
GRID: list[tuple[str, float, list[str] | None]] = [
    ("sharegpt-synth", 0.9, None),
    ("nano", 0.9, None),
    ("long-prompts", 0.9, None),
    ("long-docs", 0.7, ["fifo", "mixed"]),
    ("long-docs", 0.9, None),
    ("nano", 3.0, ["fifo", "priority"]),
]
LABELS = {"sharegpt-synth": "sharegpt-synth", "nano": "nano-vllm", "long-prompts": "long prompts",
          "long-docs": "long documents among chat"}  # fmt: skip


def shown(ms: float) -> str:
    return f"{ms:,.1f}" if ms < 100 else f"{ms:,.0f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Simulate the scheduler policies on the workloads where they differ.")
    parser.add_argument("--extra-policy", action="append", default=[], metavar="NAME=MODULE:CLASS",
                        help="also simulate this policy (a registered name or module:Class), repeatable")  # fmt: skip
    parser.add_argument("--saturation", default="", help="WORKLOAD=REQ_PER_S,... (default: the H200's measured rates)")
    parser.add_argument("--step-tokens", type=int, default=2048, help="the non-fifo policies' step size (default 2048)")
    parser.add_argument("--calibration", help="the simulator's calibration (default: its own default)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    add_common_arguments(parser, dry_run=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    saturation = parse_saturation(args.saturation, MEASURED_SATURATION)
    extra = dict(item.partition("=")[::2] for item in args.extra_policy)
    policies = {"fifo": "fifo", "mixed": "mixed", "priority": "priority", **{k: v or k for k, v in extra.items()}}
    rows = []
    print("| workload, load | policy | TTFT p50 / p99 ms | ITL p50 / p99 ms | class 0 / 1 TTFT p99 ms |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / LONG_DOCS_TRACE
        write_long_documents_trace(trace)
        for workload, load, chosen in GRID:
            spec = WORKLOADS[workload]
            rate = round(load * saturation[workload], 1)
            for name in chosen or list(policies):
                scheduler = None if name == "fifo" else policies[name]
                max_model_len = spec.get("max_model_len", MAX_MODEL_LEN)
                cmd = workload_command(workload, trace, spec["prompts"], rate, max_model_len, scheduler,
                                       args.step_tokens, 4, args.calibration)  # fmt: skip
                r = simulate(cmd)
                by_class = r["by_priority"]
                load_text = f"{load:.0%}" if load <= 1 else f"{rate:g} req/s ({load:g}x saturation)"
                pairs = [(r["median_ttft_ms"], r["p99_ttft_ms"]), (r["median_itl_ms"], r["p99_itl_ms"]),
                         (by_class["0"]["p99_ttft_ms"], by_class["1"]["p99_ttft_ms"])]  # fmt: skip
                cells = " | ".join(f"{shown(a)} / {shown(b)}" for a, b in pairs)
                print(f"| {LABELS[workload]}, {load_text} | `{name}` | {cells} |")
                rows.append({"workload": workload, "load": load, "request_rate": rate, "policy": name,
                             "command": "nanovllm " + " ".join(cmd),
                             "result": {k: v for k, v in r.items() if k != "simulated"}})  # fmt: skip
    if args.json:
        write_json(Path(args.json), {"rows": rows})
    else:
        write_json(out_dir(args.results_dir, "simulate") / "policy_map.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
