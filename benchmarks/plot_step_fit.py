"""Where a `nanovllm bench --json` run's GPU time goes, from its decode-step fit, beside the per-step bound (PNG).

    python benchmarks/plot_step_fit.py "Qwen3-0.6B=a.json" "Qwen3-8B=b.json" --out FILE.png

One stacked bar per result: the decode steps' fixed part (what every step pays whatever its batch), the part
that grows with the batch, the part that grows with the KV read, and the steps with prompt tokens; ticks at the
per-step bound and at the time 85% of it would allow (issue 14's target). Needs matplotlib.
"""

from __future__ import annotations

from plotting import labelled_results, plt, save

PARTS = [
    ("fixed_s", "decode: fixed per step"),
    ("per_seq_s", "decode: per sequence"),
    ("per_kv_s", "decode: per KV token read"),
    ("prompt_steps_gpu_s", "steps with prompt tokens"),
]


def main(argv: list[str] | None = None) -> None:
    args, results = labelled_results(argv, "nano-vllm workload, one H200: the run's GPU time by the decode-step fit")
    fig, ax = plt.subplots(figsize=(10, 2.0 + 1.1 * len(results)))
    labels = []
    for y, (label, r) in enumerate(results):
        fit = r["decode_step_fit"]
        left = 0.0
        for i, (key, name) in enumerate(PARTS):
            width = max(fit[key], 0.0)
            ax.barh(y, width, left=left, color=f"C{i}", label=name if y == 0 else None)
            if width > 0.25:
                ax.text(left + width / 2, y, f"{width:.2f} s", ha="center", va="center", fontsize=8, color="white")
            left += width
        bound = r["per_step_bound_s"]
        ax.vlines(bound, y - 0.4, y + 0.4, color="black", label="per-step bound" if y == 0 else None)
        ax.vlines(bound / 0.85, y - 0.4, y + 0.4, color="green", linestyle=":",
                  label="85% of the bound (target)" if y == 0 else None)  # fmt: skip
        labels.append(f"{label}\n{r['output_tok_per_s']:,.0f} tok/s, fixed {fit['fixed_ms_per_step']:.2f} ms/step")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU seconds of the timed run")
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    save(fig, args.out, 130)


if __name__ == "__main__":
    main()
