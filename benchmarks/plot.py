"""The plots of docs/performance.md, from what the other scripts wrote to the results folder.

    python benchmarks/plot.py                      # reads results/, writes results/plots/*.png
    python benchmarks/plot.py --results-dir DIR

- ``offline.png`` (from ``offline.py``): output tok/s of each workload's first and best later run, with the bound
  ``nanovllm bench`` reported as a tick.
- ``serving_latency.png`` (from ``serving.py``): TTFT (median, p99), p99 ITL and output tok/s against request rate.
- ``policies.png`` (from ``policies.py``): p99 ITL and p99 TTFT of each policy against load, one row per workload.

A plot whose results are missing is skipped, with a line saying so. Needs matplotlib, which no nanovllm package
depends on (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> Any:
    return json.loads(path.read_text())


def offline_plot(plt: Any, folder: Path, out: Path) -> bool:
    results = []
    for path in sorted(folder.glob("*.json")):
        data = load(path)
        if path.name != "summary.json" and isinstance(data, dict) and "runs_tok_per_s" in data:
            results.append((path.stem, data))
    if not results:
        return False
    fig, ax = plt.subplots(figsize=(max(5.0, 2.0 + 1.6 * len(results)), 4.2))
    for x, (_name, r) in enumerate(results):
        runs = r["runs_tok_per_s"]
        ax.bar(x - 0.2, runs[0], 0.4, color="C0", label="first run" if x == 0 else None)
        if len(runs) > 1:
            ax.bar(x + 0.2, max(runs[1:]), 0.4, color="C1", label="best later run" if x == 0 else None)
        bound = r.get("per_step_bound_tok_per_s")
        if bound:
            ax.hlines(bound, x - 0.45, x + 0.45, colors="k", linestyles="dashed", label="bound" if x == 0 else None)
            ax.text(x, bound, f"{100 * runs[0] / bound:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(results)), [name for name, _ in results])
    ax.set_ylabel("output tok/s")
    device = results[0][1].get("device", "")
    ax.set_title(f"nano-vllm's workload, offline\n{device}")
    ax.legend(fontsize=8)
    save(fig, out)
    return True


def runs_of(path: Path) -> list[dict[str, Any]]:
    data = load(path)
    return sorted(data.get("runs", [data]), key=lambda r: r["request_rate"])


def serving_plot(plt: Any, folder: Path, out: Path) -> bool:
    path = folder / "rates.json"
    if not path.is_file():
        return False
    runs = [r for r in runs_of(path) if math.isfinite(r["request_rate"])]
    rates = [r["request_rate"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        axes[0].plot(rates, [r[key] for r in runs], marker="o", label=label)
    axes[0].set_ylabel("ms")
    axes[0].set_yscale("log")
    for key, label in (("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"), ("median_tpot_ms", "TPOT p50")):
        axes[1].plot(rates, [r[key] for r in runs], marker="o", label=label)
    axes[1].set_ylabel("ms")
    axes[2].plot(rates, [r["output_throughput"] for r in runs], marker="o")
    axes[2].set_ylabel("output tok/s")
    for ax in axes:
        ax.set_xlabel("offered request rate (req/s)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"nanovllm serve, {runs[0].get('dataset', '')}, latency against rate" if runs else "")
    save(fig, out)
    return True


def policies_plot(plt: Any, folder: Path, out: Path) -> bool:
    path = folder / "summary.json"
    if not path.is_file():
        return False
    rows = [
        r
        for r in load(path)["rows"]
        if r["kind"] == "loads" and r["request_rate"] is not None and math.isfinite(r["request_rate"])
    ]
    workloads = sorted({r["workload"] for r in rows})
    if not workloads:
        return False
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.4 * len(workloads)), squeeze=False)
    for i, workload in enumerate(workloads):
        for policy in sorted({r["policy"] for r in rows if r["workload"] == workload}):
            mine = sorted(
                (r for r in rows if r["workload"] == workload and r["policy"] == policy),
                key=lambda r: r["request_rate"],
            )
            rates = [r["request_rate"] for r in mine]
            axes[i][0].plot(rates, [r["p99_itl_ms"] for r in mine], marker="o", label=policy)
            axes[i][1].plot(rates, [r["p99_ttft_ms"] for r in mine], marker="o", label=policy)
        axes[i][0].set_title(f"{workload}: p99 inter-token latency")
        axes[i][1].set_title(f"{workload}: p99 time to first token")
        for ax in axes[i]:
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
    save(fig, out)
    return True


def save(fig: Any, out: Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate docs/performance.md's plots from the results folder into RESULTS_DIR/plots/."
    )
    parser.add_argument("--results-dir", default="results", help="the folder the other scripts wrote (default results)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py needs matplotlib, which no nanovllm package depends on: pip install matplotlib", file=sys.stderr)
        return 1
    results = Path(args.results_dir)
    if not results.is_dir():
        print(f"no results folder at {results}: run the benchmarks first (benchmarks/README.md)", file=sys.stderr)
        return 1
    plots = results / "plots"
    made = 0
    for draw, source, name in (
        (offline_plot, "offline", "offline.png"),
        (serving_plot, "serving", "serving_latency.png"),
        (policies_plot, "policies", "policies.png"),
    ):
        if draw(plt, results / source, plots / name):
            made += 1
        else:
            print(f"skipped {name}: no results in {results / source} (benchmarks/{source}.py writes them)")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
