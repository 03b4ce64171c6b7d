"""p99 inter-token latency and p99 TTFT against request rate, one line per scheduler (PNG).

    python benchmarks/plot_schedulers.py fifo=FILE mixed=FILE [--out docs/benchmarks/r2/schedulers.png]

Each FILE is a ``nanovllm bench serve --rates ... --result-file FILE`` result. Needs matplotlib (not a dependency
of any package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", help="NAME=FILE")
    parser.add_argument("--out", default="docs/benchmarks/r2/schedulers.png")
    parser.add_argument("--title", default="Qwen3-0.6B shape, one H200, sharegpt-synth, 400 requests per rate")
    args = parser.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for item in args.results:
        name, path = item.split("=", 1)
        data = json.loads(Path(path).read_text())
        runs = sorted(data.get("runs", [data]), key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in runs]
        axes[0].plot(rates, [r["p99_itl_ms"] for r in runs], "o-", label=f"{name} p99 ITL")
        axes[0].plot(rates, [r["median_itl_ms"] for r in runs], "x:", label=f"{name} median ITL")
        axes[1].plot(rates, [r["p99_ttft_ms"] for r in runs], "o-", label=f"{name} p99 TTFT")
    for ax, label in ((axes[0], "inter-token latency (ms)"), (axes[1], "time to first token (ms)")):
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
