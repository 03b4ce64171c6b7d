"""Latency vs request rate (PNG) from ``nanovllm bench serve --rates R1,R2,...,inf --result-file FILE``.

    python benchmarks/plot_serving.py FILE [--out docs/benchmarks/serving_latency.png] [--title TEXT]

Needs matplotlib (not a dependency of any package). Three panels over the offered request rate (``inf``: every
request at once): TTFT and TPOT (median and p99), and the output throughput reached.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from plotting import plt, save

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "serving_latency.png"


def load_runs(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    runs = data["runs"] if "runs" in data else [data]
    return sorted(runs, key=lambda r: r["request_rate"])


def plot(runs: list[dict], out: Path, title: str) -> None:
    labels = ["all at once" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}" for r in runs]
    x = range(len(runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        ax.plot(x, [r[f"median_{metric}_ms"] for r in runs], "o-", label=f"median {name}")
        ax.plot(x, [r[f"p99_{metric}_ms"] for r in runs], "s--", label=f"p99 {name}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    axes[2].plot(x, [r["output_throughput"] for r in runs], "o-", color="green")
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    save(fig, out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result_file", type=Path)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--title", default="nanovllm serve: latency vs request rate")
    args = parser.parse_args()
    plot(load_runs(args.result_file), args.out, args.title)


if __name__ == "__main__":
    main()
