"""Output tok/s of `nanovllm bench --json` results beside both bounds and 85% of the per-step one (PNG).

    python benchmarks/plot_bounds.py "0.6B bf16=a.json" "0.6B fp8=b.json" "8B bf16=c.json" ... --out FILE.png

One bar per result. Its two bounds are drawn as ticks on the bar: the additive bound (memory + compute time)
and the per-step one (each decode step the longer of its bytes and FLOPs). A result on an FP8 KV cache is
drawn against the bf16 cache's bounds, which its JSON reports. A result of ``nanovllm bench --sustained-gemm-s``
also gets the per-step bound at the GEMM rate the GPU sustained (a dash-dotted tick). Needs matplotlib (not a
dependency of any package).
"""

from __future__ import annotations

from plotting import labelled_results, plt, save


def main(argv: list[str] | None = None) -> None:
    args, results = labelled_results(argv, "nano-vllm workload (256 seqs, 133,966 output tokens), one H200")
    fig, ax = plt.subplots(figsize=(10, 4.6))
    sustained_labelled = False
    for x, (label, r) in enumerate(results):
        value, additive, per_step = r["output_tok_per_s"], r["bound_tok_per_s"], r["per_step_bound_tok_per_s"]
        ax.bar(x, value, 0.6, color="C1" if "fp8" in label.lower() else "C0")
        ax.text(x, value * 1.01, f"{value:,.0f}\n{100 * value / per_step:.0f}% / {100 * value / additive:.0f}%",
                ha="center", va="bottom", fontsize=8)
        ax.hlines(per_step, x - 0.35, x + 0.35, color="black", label="per-step bound" if x == 0 else None)
        ax.hlines(additive, x - 0.35, x + 0.35, color="gray", linestyle="--",
                  label="additive bound" if x == 0 else None)
        ax.hlines(0.85 * per_step, x - 0.35, x + 0.35, color="green", linestyle=":",
                  label="85% of the per-step bound (target)" if x == 0 else None)
        sustained = r.get("per_step_bound_sustained_tok_per_s")
        if sustained:
            ax.hlines(sustained, x - 0.35, x + 0.35, color="purple", linestyle="-.",
                      label=None if sustained_labelled else "per-step bound at the sustained GEMM rate")
            sustained_labelled = True
            ax.text(x + 0.37, sustained, f"{100 * value / sustained:.0f}%", va="center", fontsize=7, color="purple")
    ax.set_xticks(range(len(results)), [label for label, _ in results], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens / s (log scale)")
    ax.set_title(args.title + "; labels: tok/s, % of per-step / additive bound", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    save(fig, args.out, dpi=120)


if __name__ == "__main__":
    main()
