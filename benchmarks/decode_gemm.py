"""How fast the decode step's projections read their weights: each layer's GEMM at the batch sizes decode meets.

    python benchmarks/decode_gemm.py [--shape qwen3-0.6b] [--rows 1,16,64,128,256,512] [--blas default,cublaslt]
                                     [--iters 50] [--json PATH]

A decode step multiplies ``rows`` activations (one per running sequence) by every weight matrix once: at small
``rows`` the step should stream the weights at the copy rate. For each projection of the shape (``qkv``, ``o``,
``gate_up``, ``down`` and ``lm_head``, as the engine's fused layers hold them, unsharded) and each row count this
times ``F.linear`` in bf16 (``--iters`` calls captured in a CUDA graph, as the engine replays a decode step; CUDA
events around 5 replays, the median per call; each call takes the next of enough copies of the matrix to outgrow
the L2 cache, as the layers of a step do)
and reports microseconds, TFLOP/s and the weights' read rate in TB/s against the device's copy rate (the
``nanovllm bench`` bound's). ``--blas`` names PyTorch's BLAS back-ends to compare
(``torch.backends.cuda.preferred_blas_library``). The one-GPU issue puts the 0.6B step's small-M GEMMs at about
1.1 TB/s of weights: this measures it per layer. On a machine without CUDA it runs on the CPU with ``--rows``
as given (a check of the script, not a measurement of interest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from nanovllm_core.benchmark import SHAPES, measure_device


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(input features, output features) of each decode projection, as the engine fuses them."""
    hidden, heads, kv_heads, head_dim = (
        shape["hidden_size"],
        shape["num_heads"],
        shape["num_kv_heads"],
        shape["head_dim"],
    )
    inter = shape["intermediate_size"]
    return {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o": (heads * head_dim, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "lm_head": (hidden, shape["vocab_size"]),
    }


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], iters: int, fn: Callable = F.linear) -> float:
    """Seconds per ``F.linear(x, w)``, ``w`` taken in turn from ``weights`` (copies of one matrix that together
    outgrow the L2 cache, as a step's layers do: each call reads its weights from DRAM, not from L2).

    On CUDA the ``iters`` calls are captured in one CUDA graph and the replays are timed, as the engine's decode
    steps run them: launched back to back from Python, a GEMM of a few microseconds waits on its launch."""

    def calls() -> None:
        for i in range(iters):
            fn(x, weights[i % len(weights)])

    runs = []
    if x.is_cuda:
        calls()  # warm-up: cuBLAS picks its kernels and workspace outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        graph.replay()
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / iters)
    else:
        calls()
        for _ in range(5):
            t0 = time.perf_counter()
            calls()
            runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


COLD_BYTES = 256 << 20  # the copies of a weight matrix one timing cycles through: several times an H200's L2


def triton_candidates(m: int, k: int) -> list[Any]:
    """The Triton GEMM launch shapes tried for ``m`` rows and ``k`` input features."""
    from nanovllm_core.layers.gemm_kernel import GemmConfig

    rows_tile = max(16, 1 << (m - 1).bit_length())
    block_ms = sorted({min(rows_tile, 64), min(rows_tile, 32)} | ({128} if m >= 128 else set()))
    configs = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4, 8):
                    if split * bk <= k:
                        configs.append(GemmConfig(bm, bn, bk, split, num_warps=4, num_stages=4 if bk == 64 else 3))
    return configs


def _compile_share(args: tuple[list[tuple[int, int, int]], list[Any], int, int]) -> int:
    """Compile (by running once, on small inputs of the same specialisation) every (m, n, k) x config of one
    share of the sweep, so the timing process finds Triton's on-disk cache warm."""
    from nanovllm_core.layers.gemm_kernel import gemm

    tasks, configs_of, index, total = args
    done = 0
    for i, (m, n, k) in enumerate(tasks):
        for j, config in enumerate(configs_of[i]):
            if (i * 1000 + j) % total == index:
                x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
                w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
                gemm(x, w, config)
                done += 1
    torch.cuda.synchronize()
    return done


def precompile(tasks: list[tuple[int, int, int]], workers: int) -> float:
    """Compile the sweep's kernels in ``workers`` processes (Triton compiles one kernel at a time per process)."""
    import multiprocessing as mp

    configs_of = [triton_candidates(m, k) for m, _, k in tasks]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_share, [(tasks, configs_of, i, workers) for i in range(workers)])
    return time.perf_counter() - t0


def measure(shape_name: str, rows: list[int], blas: list[str], iters: int, workers: int = 8) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_rate = measure_device(device).get("copy_bytes_per_s") if device.type == "cuda" else None
    results, sweep = [], []
    layers = projections(SHAPES[shape_name])
    report: dict[str, Any] = {}
    if "triton" in blas and device.type == "cuda":
        tasks = [(m, n, k) for name, (k, n) in layers.items() if name != "lm_head" for m in rows]
        report["compile_s"] = precompile(tasks, workers)
    for backend in blas if device.type == "cuda" else ["default"]:
        if device.type == "cuda" and backend not in ("default", "triton"):
            torch.backends.cuda.preferred_blas_library(backend)
        for name, (k, n) in layers.items():
            if backend == "triton" and name == "lm_head":
                continue
            w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
            weight_bytes = w.numel() * w.element_size()
            copies = min(64, -(-COLD_BYTES // weight_bytes)) if device.type == "cuda" else 1
            weights = [w] + [w.clone() for _ in range(copies - 1)]
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device=device)
                config = None
                if backend == "triton":
                    from nanovllm_core.layers.gemm_kernel import gemm

                    reference = F.linear(x, w)
                    timed = []
                    for candidate in triton_candidates(m, k):
                        error = (gemm(x, w, candidate) - reference).abs().max().item()
                        us = time_linear(x, weights, iters, lambda a, b, c=candidate: gemm(a, b, c)) * 1e6
                        timed.append((us, candidate))
                        sweep.append({"layer": name, "rows": m, "config": candidate.short(), "us": us,
                                      "max_abs_err": error})  # fmt: skip
                    seconds, config = min(timed, key=lambda t: t[0])
                    seconds /= 1e6
                else:
                    seconds = time_linear(x, weights, iters)
                results.append({
                    "blas": backend, "layer": name, "rows": m, "in": k, "out": n, "us": seconds * 1e6,
                    "tflops": 2 * m * k * n / seconds / 1e12, "weight_tb_per_s": weight_bytes / seconds / 1e12,
                    **({"config": config.short()} if config else {}),
                })  # fmt: skip
            del w, weights
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("default")
    return {
        "shape": shape_name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "copy_tb_per_s": copy_rate / 1e12 if copy_rate else None,
        **report,
        "results": results,
        "sweep": sweep,
    }


def print_table(report: dict[str, Any]) -> None:
    copy = report["copy_tb_per_s"]
    print(
        f"{report['shape']} on {report['device']}, {report['dtype']}" + (f", copy rate {copy:.2f} TB/s" if copy else "")
    )
    print(f"{'blas':9} {'layer':8} {'in x out':>14} {'rows':>5} {'us':>9} {'TFLOP/s':>8} {'weights TB/s':>13}")
    for r in report["results"]:
        share = f" ({100 * r['weight_tb_per_s'] / copy:.0f}%)" if copy else ""
        print(
            f"{r['blas']:9} {r['layer']:8} {r['in']:>6} x {r['out']:<6} {r['rows']:>5} {r['us']:>9.1f} "
            f"{r['tflops']:>8.1f} {r['weight_tb_per_s']:>7.2f}{share} {r.get('config', '')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--rows", default="1,16,64,128,256,512", help="comma-separated batch sizes (rows)")
    parser.add_argument(
        "--blas", default="default,cublaslt", help="comma-separated BLAS back-ends to compare; 'triton' sweeps the "
        "Triton decode GEMM's launch shapes (nanovllm_core.layers.gemm_kernel) and reports the fastest"
    )
    parser.add_argument("--compile-workers", type=int, default=8, help="processes compiling the Triton sweep")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="write the report here ('-': stdout)")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: comma-separated positive integers, e.g. 1,64,256")
    if not rows or min(rows) < 1:
        parser.error(f"--rows {args.rows!r}: comma-separated positive integers, e.g. 1,64,256")
    backends = [b.strip() for b in args.blas.split(",") if b.strip()]
    report = measure(args.shape, rows, backends, args.iters, args.compile_workers)
    print_table(report)
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
