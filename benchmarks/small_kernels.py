"""Small kernels of a step, timed as CUDA-graph replays: SiLU-and-mul and (add-)RMSNorm (the Triton kernels
against ``torch.compile``'s fusions) and the decode-attention split merge at each ``num_warps``.

    python benchmarks/small_kernels.py [--layers 36] [--iters 5]

Round 13's profiles had ``torch.compile``'s SiLU-and-mul at a third of the copy rate, its 8B add-RMSNorm at
3.6 us a call for 256 rows, and the split merge at 13.5 us a call for 128 sequences of Qwen3-8B (4 splits, 32
heads). Each case captures one call per layer (each
on its own input, as a step's layers are) in a CUDA graph and reports the median microseconds a call over
``--iters`` replays. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

SILU_CASES = [  # (name, rows, intermediate size)
    ("0.6B decode", 64, 3072),
    ("0.6B decode", 256, 3072),
    ("0.6B prompt step", 14336, 3072),
    ("8B decode", 64, 12288),
    ("8B decode", 128, 12288),
    ("8B decode", 256, 12288),
    ("8B prompt step", 14336, 12288),
]
NORM_CASES = [  # (name, rows, hidden size)
    ("0.6B decode", 64, 1024),
    ("0.6B decode", 256, 1024),
    ("0.6B prompt step", 14336, 1024),
    ("8B decode", 64, 4096),
    ("8B decode", 256, 4096),
    ("8B prompt step", 14336, 4096),
]
MERGE_CASES = [  # (name, sequences, query heads, splits): the split counts choose_num_splits gives on an H200
    ("0.6B FP8", 64, 16, 8),
    ("0.6B FP8", 256, 16, 2),
    ("8B FP8", 64, 32, 8),
    ("8B FP8", 128, 32, 4),
    ("8B FP8", 256, 32, 2),
]


def graph_us(calls: list, iters: int) -> float:
    """Median microseconds a call of ``calls`` (one graph replay runs them all)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up and compilation outside the capture
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


def silu_table(layers: int, iters: int) -> None:
    from nanovllm_core.layers.fused import set_compile
    from nanovllm_core.layers.fused import silu_and_mul as compiled
    from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul as triton_kernel

    set_compile(True)
    print("| SiLU-and-mul | rows | intermediate | torch.compile us | Triton us | Triton TB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows, width in SILU_CASES:
        n = layers if rows <= 1024 else 4  # prompt-step inputs are large: four are past the L2 already
        xs = [torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        us = [graph_us([lambda x=x, f=f: f(x) for x in xs], iters) for f in (compiled, triton_kernel)]
        tbs = rows * width * 3 * 2 / (us[1] * 1e-6) / 1e12
        print(f"| {name} | {rows} | {width} | {us[0]:.1f} | {us[1]:.1f} | {tbs:.2f} |")
    set_compile(False)


def norm_table(layers: int, iters: int) -> None:
    from nanovllm_core.layers.fused import add_rms_norm as compiled
    from nanovllm_core.layers.fused import set_compile
    from nanovllm_core.layers.rms_norm_kernel import rms_norm as triton_kernel

    set_compile(True)
    print("| add-RMSNorm | rows | hidden | torch.compile us | Triton us | Triton TB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows, width in NORM_CASES:
        n = layers if rows <= 1024 else 4
        bufs = [
            [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(n)
        ]
        weight = torch.rand(width, device="cuda", dtype=torch.bfloat16)
        calls = (
            [lambda b=b, w=weight: compiled(b[0], b[1], w, 1e-6) for b in bufs],
            [lambda b=b, w=weight: triton_kernel(b[0], w, 1e-6, b[1]) for b in bufs],
        )
        us = [graph_us(c, iters) for c in calls]
        tbs = rows * width * 4 * 2 / (us[1] * 1e-6) / 1e12
        print(f"| {name} | {rows} | {width} | {us[0]:.1f} | {us[1]:.1f} | {tbs:.2f} |")
    set_compile(False)


def merge_table(layers: int, iters: int) -> None:
    import triton
    from nanovllm_attention_flash import triton_kernels

    kernels = triton_kernels._kernels_for(torch.device("cuda"))
    warps = (1, 2, 4, 8)
    print("| case | sequences | heads | splits | " + " | ".join(f"{w} warps us" for w in warps) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(warps))
    for name, seqs, heads, splits in MERGE_CASES:
        qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
        bufs = []
        for _ in range(layers):
            part_out = torch.randn(seqs, heads, splits, 128, device="cuda")
            part_lse = torch.randn(seqs, heads, splits, device="cuda")
            out = torch.empty(seqs, heads, 128, device="cuda", dtype=torch.bfloat16)
            bufs.append((part_out, part_lse, out))

        def call(buf, num_warps, qsl=qsl, grid=(heads, seqs), splits=splits):
            part_out, part_lse, out = buf
            kernels.decode_merge[grid](
                qsl,
                out,
                part_out,
                part_lse,
                splits,
                out.stride(0),
                out.stride(1),
                *part_out.stride()[:3],
                *part_lse.stride()[:2],
                HEAD_DIM=128,
                SPLITS_P2=triton.next_power_of_2(splits),
                num_warps=num_warps,
            )

        us = [graph_us([lambda b=b, w=w: call(b, w) for b in bufs], iters) for w in warps]
        print(f"| {name} | {seqs} | {heads} | {splits} | " + " | ".join(f"{u:.1f}" for u in us) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    silu_table(args.layers, args.iters)
    print()
    norm_table(args.layers, args.iters)
    print()
    merge_table(args.layers, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
