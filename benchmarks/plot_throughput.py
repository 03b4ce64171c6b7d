"""Render docs/benchmarks/throughput.png from the JSON files `nanovllm bench --json` wrote.

    python benchmarks/plot_throughput.py   (needs matplotlib; not a dependency of any package)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
RUNS = [
    ("triton_eager.json", "triton\nno graphs,\nno fused ops"),
    ("triton_no_compile.json", "triton\ngraphs"),
    ("flash_attn_sync.json", "flash_attn\ngraphs + fused,\nno overlap"),
    ("final_flash_attn.json", "flash_attn\ngraphs + fused\n+ overlap"),
    ("final_triton.json", "triton\ngraphs + fused\n+ overlap"),
]
NANO_VLLM = 14037  # nano-vllm on the same H200 (DESIGN.md)
ISSUE_TARGET = 26700  # 75% of DESIGN.md's ~35,600 tok/s bound, which counts KV reads only


def main() -> None:
    results = [(label, json.loads((HERE / name).read_text())) for name, label in RUNS]
    bound = sum(r["bound_tok_per_s"] for _, r in results) / len(results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    values = [r["output_tok_per_s"] for _, r in results]
    bars = ax.bar([label for label, _ in results], values, color="#4c72b0")
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 300, f"{value:,.0f}", ha="center", fontsize=9)
    ax.axhline(bound, color="black", linestyle="--", label=f"bound {bound:,.0f} tok/s (measured copy BW + GEMM)")
    ax.axhline(0.75 * bound, color="green", linestyle=":", label=f"75% of the measured bound {0.75 * bound:,.0f} tok/s")
    target = f"issue target {ISSUE_TARGET:,} tok/s (75% of DESIGN.md's bound)"
    ax.axhline(ISSUE_TARGET, color="gray", linestyle=":", label=target)
    ax.axhline(NANO_VLLM, color="red", linestyle="-.", label=f"nano-vllm {NANO_VLLM:,} tok/s")
    ax.set_ylabel("output tokens / s")
    ax.set_title("nano-vllm workload (256 seqs, 133,966 output tokens), Qwen3-0.6B shape, bf16, one H200")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(0, bound * 1.1)
    fig.tight_layout()
    fig.savefig(HERE / "throughput.png", dpi=110)
    print(f"wrote {HERE / 'throughput.png'}")


if __name__ == "__main__":
    main()
