"""Kernel micro-benchmarks on one GPU: paged attention, the small fused ops, the decode step's GEMMs.

    python benchmarks/gpu_kernels.py                                   # every suite
    python benchmarks/gpu_kernels.py --suites attention --attention-args "--sweep decode --kv-cache-dtype fp8"
    python benchmarks/gpu_kernels.py --dry-run                         # the commands, nothing run

Suites, each in a process of its own:

- ``attention``: ``plugins/attention_flash/bench_kernels.py``, the attention plugin's own benchmark: decode and
  prefill for ``triton`` on the bf16 and the fp8 cache, ``flash_attn`` (flash-attn-4) and ``torch`` where they
  are installed, microseconds, effective bandwidth and TFLOP/s (``--attention-args`` passes it more flags, such
  as ``--sweep decode`` for the tile sweep).
- ``small-ops``: the core's Triton kernels for SiLU-and-mul and add-RMSNorm against ``torch.compile``'s fusions,
  at the decode and prompt-step sizes of the Qwen3-0.6B and 8B shapes, each call timed as a CUDA-graph replay
  with one input per layer (as a step's layers run them).
- ``gemm``: ``benchmarks/decode_gemm.py`` for each of ``--shapes``: every projection of a layer at the batch
  sizes decode meets, and the rate it reads its weights at against the copy rate.

Results go to RESULTS_DIR/kernels/: attention.md, small_ops.md, decode_gemm_SHAPE.json and each suite's log.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from _common import ROOT, add_common_arguments, add_selection_argument, out_dir, run, shown, split_list

SUITES = ["attention", "small-ops", "gemm"]
ATTENTION_BENCH = ROOT / "plugins" / "attention_flash" / "bench_kernels.py"
SILU_CASES = [  # (case, rows, intermediate size)
    ("0.6B decode", 64, 3072),
    ("0.6B decode", 256, 3072),
    ("0.6B prompt step", 14336, 3072),
    ("8B decode", 64, 12288),
    ("8B decode", 256, 12288),
    ("8B prompt step", 14336, 12288),
]
NORM_CASES = [  # (case, rows, hidden size)
    ("0.6B decode", 64, 1024),
    ("0.6B decode", 256, 1024),
    ("0.6B prompt step", 14336, 1024),
    ("8B decode", 64, 4096),
    ("8B decode", 256, 4096),
    ("8B prompt step", 14336, 4096),
]


def graph_us(calls: list[Callable[[], object]], iters: int) -> float:
    """Median microseconds a call of ``calls``, captured in one CUDA graph and replayed ``iters`` times."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:  # compilation and autotuning outside the capture
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def inputs_per_case(rows: int, layers: int) -> int:
    # a prompt step's inputs are large: four already outgrow the L2 cache, as a step's layers do
    return layers if rows <= 1024 else 4


def silu_table(layers: int, iters: int) -> list[str]:
    import torch

    from nanovllm_core.layers.fused import set_compile
    from nanovllm_core.layers.fused import silu_and_mul as compiled
    from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul as triton_kernel

    lines = [
        "| SiLU-and-mul | rows | intermediate | torch.compile us | Triton us | Triton TB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    set_compile(True)
    try:
        for case, rows, width in SILU_CASES:
            xs = [
                torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
                for _ in range(inputs_per_case(rows, layers))
            ]
            us = [graph_us([lambda x=x, f=f: f(x) for x in xs], iters) for f in (compiled, triton_kernel)]
            rate = rows * width * 3 * 2 / (us[1] * 1e-6) / 1e12  # reads gate and up, writes the product
            lines.append(f"| {case} | {rows} | {width} | {us[0]:.1f} | {us[1]:.1f} | {rate:.2f} |")
    finally:
        set_compile(False)
    return lines


def norm_table(layers: int, iters: int) -> list[str]:
    import torch

    from nanovllm_core.layers.fused import add_rms_norm as compiled
    from nanovllm_core.layers.fused import set_compile
    from nanovllm_core.layers.rms_norm_kernel import rms_norm as triton_kernel

    lines = [
        "| add-RMSNorm | rows | hidden | torch.compile us | Triton us | Triton TB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    set_compile(True)
    try:
        for case, rows, width in NORM_CASES:
            bufs = [
                [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                for _ in range(inputs_per_case(rows, layers))
            ]
            weight = torch.rand(width, device="cuda", dtype=torch.bfloat16)
            calls = (
                [lambda b=b, w=weight: compiled(b[0], b[1], w, 1e-6) for b in bufs],
                [lambda b=b, w=weight: triton_kernel(b[0], w, 1e-6, b[1]) for b in bufs],
            )
            us = [graph_us(c, iters) for c in calls]
            rate = rows * width * 4 * 2 / (us[1] * 1e-6) / 1e12  # reads x and the residual, writes both
            lines.append(f"| {case} | {rows} | {width} | {us[0]:.1f} | {us[1]:.1f} | {rate:.2f} |")
    finally:
        set_compile(False)
    return lines


def small_ops(out: Path, layers: int, iters: int) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the small-ops suite needs a CUDA device", file=sys.stderr)
        return 1
    text = "\n".join([torch.cuda.get_device_name(), "", *silu_table(layers, iters), "", *norm_table(layers, iters)])
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"wrote {out}")
    return 0


def commands(args: argparse.Namespace, folder: Path) -> dict[str, list[str]]:
    suites = split_list(args.suites, SUITES, "--suites")
    cmds: dict[str, list[str]] = {}
    if "attention" in suites:
        cmds["attention"] = [
            sys.executable,
            str(ATTENTION_BENCH),
            "--out",
            str(folder / "attention.md"),
            *shlex.split(args.attention_args),
        ]
    if "small-ops" in suites:
        cmds["small_ops"] = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--small-ops-out",
            str(folder / "small_ops.md"),
            "--layers",
            str(args.layers),
            "--iters",
            str(args.iters),
        ]
    if "gemm" in suites:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            cmds[f"decode_gemm_{shape}"] = [
                sys.executable,
                str(Path(__file__).resolve().parent / "decode_gemm.py"),
                "--shape",
                shape,
                "--json",
                str(folder / f"decode_gemm_{shape}.json"),
            ]
    return cmds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Kernel micro-benchmarks (attention, small fused ops, decode GEMMs); results in "
        "RESULTS_DIR/kernels/."
    )
    add_selection_argument(parser, "--suites", SUITES)
    parser.add_argument(
        "--attention-args",
        default="",
        metavar="FLAGS",
        help="more flags for bench_kernels.py, one quoted string (its --help lists them)",
    )
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b", help="the gemm suite's model shapes")
    parser.add_argument("--layers", type=int, default=36, help="small-ops: inputs per graph, one a layer")
    parser.add_argument("--iters", type=int, default=5, help="small-ops: graph replays timed (the median is kept)")
    parser.add_argument(
        "--small-ops-out",
        type=Path,
        metavar="PATH",
        help="run the small-ops tables in this process and write them here",
    )
    add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.layers < 1 or args.iters < 1:
        raise SystemExit("error: --layers and --iters: at least 1")
    if args.small_ops_out:
        return small_ops(args.small_ops_out, args.layers, args.iters)
    folder = out_dir(args.results_dir, "kernels", make=not args.dry_run)
    cmds = commands(args, folder)
    if "attention" in cmds and not ATTENTION_BENCH.is_file():
        raise SystemExit(f"error: the attention suite runs {ATTENTION_BENCH}, which this checkout lacks")
    if args.dry_run:
        for cmd in cmds.values():
            print(shown(cmd))
        return 0
    failed = [name for name, cmd in cmds.items() if run(cmd, folder / f"{name}.log") != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (see their logs in {folder})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
