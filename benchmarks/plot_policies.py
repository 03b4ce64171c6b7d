"""p99 ITL and p99 TTFT of each scheduler at one load, one group of bars per workload (PNG).

    python benchmarks/plot_policies.py "long prompts" fifo=A.json mixed=B.json priority=C.json \
        --workload nano fifo=D.json mixed=E.json priority=F.json --out docs/benchmarks/r8/policies_at_70.png

Each FILE is a single-rate ``nanovllm bench serve --result-file FILE`` result; a result with priority classes
also gets a bar per class for TTFT. Needs matplotlib (not a dependency of any package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plotting import plt, save


def parse(argv: list[str] | None = None) -> tuple[dict[str, dict[str, dict]], argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("first", help="the first workload's name")
    parser.add_argument("items", nargs="+", help="NAME=FILE, or --workload NAME to start the next group")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="Qwen3-0.6B shape, one H200, 70% of fifo's all-at-once rate")
    args, rest = parser.parse_known_args(argv)
    groups: dict[str, dict[str, dict]] = {args.first: {}}
    current = args.first
    tokens = list(args.items) + rest
    while tokens:
        token = tokens.pop(0)
        if token == "--workload":
            current = tokens.pop(0)
            groups[current] = {}
            continue
        name, path = token.split("=", 1)
        groups[current][name] = json.loads(Path(path).read_text())
    return groups, args


def main(argv: list[str] | None = None) -> None:
    groups, args = parse(argv)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    width = 0.8 / max(len(g) + sum(len(r.get("by_priority", {})) for r in g.values()) for g in groups.values())
    names = list(dict.fromkeys(name for results in groups.values() for name in results))
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    for g, results in enumerate(groups.values()):
        x = g
        for i, (name, result) in enumerate(results.items()):
            color = colors[name]
            xi = g + i * width
            axes[0].bar(xi, result["p99_itl_ms"], width, color=color, label=name if g == 0 else None)
            axes[0].text(xi, result["p99_itl_ms"], f"{result['p99_itl_ms']:.1f}", ha="center", va="bottom", fontsize=7)
            axes[1].bar(x, result["p99_ttft_ms"], width, color=color, label=name if g == 0 else None)
            axes[1].text(x, result["p99_ttft_ms"], f"{result['p99_ttft_ms']:.0f}", ha="center", va="bottom", fontsize=7)
            x += width
            for cls, c in result.get("by_priority", {}).items():
                axes[1].bar(x, c["p99_ttft_ms"], width, color=color, alpha=0.5 + 0.25 * (cls == "0"),
                            hatch="//" if cls != "0" else None, label=f"{name} class {cls}" if g == 0 else None)
                axes[1].text(x, c["p99_ttft_ms"], f"{c['p99_ttft_ms']:.0f}", ha="center", va="bottom", fontsize=7)
                x += width
    for ax, label in ((axes[0], "p99 inter-token latency (ms)"), (axes[1], "p99 time to first token (ms)")):
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups), fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(args.title, fontsize=10)
    save(fig, args.out, dpi=120)


if __name__ == "__main__":
    main()
