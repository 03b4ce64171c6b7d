"""The decode projections with the op before them fused in, against cuBLAS after that op's own kernel.

    python benchmarks/fused_gemm.py [--shape qwen3-0.6b] [--rows 16,64,128,256] [--iters 50] [--json PATH]

For ``qkv`` and ``gate_up`` the op is the add-and-RMSNorm before them, for ``down`` SwiGLU's ``silu(gate) * up``.
``unfused`` times what the engine runs without ``fuse_decode_gemms``: the torch.compile'd norm (or activation)
kernel, then ``F.linear``. ``fused`` sweeps the Triton GEMM's launch shapes with the op as its prologue
(``nanovllm_core.layers.gemm_kernel``, ``prologue="norm"`` / ``"silu"``) and reports the fastest. Both are timed
as ``decode_gemm.py`` times a GEMM: ``--iters`` calls in one CUDA graph, each on the next of enough weight copies
to outgrow the L2 cache. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from decode_gemm import COLD_BYTES, projections, time_linear  # noqa: E402

from nanovllm_core.benchmark import SHAPES  # noqa: E402

PROLOGUE = {"qkv": "norm", "gate_up": "norm", "down": "silu"}


def candidates(m: int, prologue: str) -> list[Any]:
    from nanovllm_core.layers.gemm_config import GemmConfig

    block_ms = [16] if m <= 16 else [32, 64] if m <= 64 else [64, 128]
    splits = (1,) if prologue == "norm" else (1, 2, 4, 8)
    block_ns = (32, 64, 128) if prologue == "norm" else (32, 64)
    out = []
    for bm in block_ms:
        for bn in block_ns:
            for bk in (32, 64, 128):
                for split in splits:
                    for warps in (4, 8):
                        out.append(GemmConfig(bm, bn, bk, split, num_warps=warps, num_stages=4 if bk < 128 else 3))
    return out


def inputs(prologue: str, m: int, k: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    bf16 = torch.bfloat16
    if prologue == "norm":
        return {
            "x": torch.randn(m, k, dtype=bf16, device=device),
            "residual": torch.randn(m, k, dtype=bf16, device=device),
            "norm_weight": (torch.rand(k, device=device) + 0.5).to(bf16),
        }
    return {"x": torch.randn(m, 2 * k, dtype=bf16, device=device)}


def fused_call(prologue: str, tensors: dict[str, torch.Tensor], config: Any):
    from nanovllm_core.layers.gemm_kernel import gemm

    if prologue == "norm":
        x, residual, g = tensors["x"], tensors["residual"], tensors["norm_weight"]
        return lambda _x, w: gemm(x, w, config, prologue="norm", norm_weight=g, residual=residual, eps=1e-6)
    return lambda x, w: gemm(x, w, config, prologue="silu")


def unfused_call(prologue: str, tensors: dict[str, torch.Tensor]):
    from nanovllm_core.layers.fused import add_rms_norm, silu_and_mul

    if prologue == "norm":
        residual, g = tensors["residual"], tensors["norm_weight"]
        return lambda x, w: F.linear(add_rms_norm(x, residual, g, 1e-6)[0], w)
    return lambda x, w: F.linear(silu_and_mul(x), w)


def _compile_share(args: tuple[list[tuple[str, int, int, int]], int, int]) -> int:
    tasks, index, total = args
    done = 0
    for i, (prologue, m, n, k) in enumerate(tasks):
        for j, config in enumerate(candidates(m, prologue)):
            if (i * 1000 + j) % total == index:
                tensors = inputs(prologue, m, k)
                fused_call(prologue, tensors, config)(tensors["x"], torch.zeros(n, k, dtype=torch.bfloat16,
                                                                                device="cuda"))  # fmt: skip
                done += 1
    torch.cuda.synchronize()
    return done


def measure(shape_name: str, rows: list[int], iters: int, workers: int) -> dict[str, Any]:
    from nanovllm_core.layers.fused import set_compile

    set_compile(True)  # the engine's unfused path: torch.compile'd norm and activation
    layers = {name: shape for name, shape in projections(SHAPES[shape_name]).items() if name in PROLOGUE}
    tasks = [(PROLOGUE[name], m, n, k) for name, (k, n) in layers.items() for m in rows]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_share, [(tasks, i, workers) for i in range(workers)])
    compile_s = time.perf_counter() - t0
    results, sweep = [], []
    for name, (k, n) in layers.items():
        prologue = PROLOGUE[name]
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        copies = min(64, -(-COLD_BYTES // (w.numel() * 2)))
        weights = [w] + [w.clone() for _ in range(copies - 1)]
        for m in rows:
            tensors = inputs(prologue, m, k)
            reference = unfused_call(prologue, tensors)(tensors["x"], w)
            unfused_us = time_linear(tensors["x"], weights, iters, unfused_call(prologue, tensors)) * 1e6
            timed = []
            for config in candidates(m, prologue):
                fn = fused_call(prologue, tensors, config)
                out = fn(tensors["x"], w)
                out = out[0] if isinstance(out, tuple) else out
                error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                us = time_linear(tensors["x"], weights, iters, fn) * 1e6
                timed.append((us, config))
                sweep.append({"layer": name, "rows": m, "config": config.short(), "us": us, "rel_err": error})
            best_us, best = min(timed, key=lambda t: t[0])
            results.append({"layer": name, "prologue": prologue, "rows": m, "in": k, "out": n,
                            "unfused_us": unfused_us, "fused_us": best_us, "config": best.short()})  # fmt: skip
            print(f"{name:8} {prologue:5} rows {m:4}: unfused {unfused_us:6.1f} us, fused {best_us:6.1f} us "
                  f"({best.short()})", flush=True)  # fmt: skip
        del w, weights
    return {"shape": shape_name, "device": torch.cuda.get_device_name(), "compile_s": compile_s,
            "results": results, "sweep": sweep}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--rows", default="16,64,128,256")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--compile-workers", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument(
        "--write-table", help="write a launch-shape table (gemm_configs.json's form, for $NANOVLLM_GEMM_CONFIGS): per "
        "layer and measured row count the fastest fused config where it beat unfused, else null (unfused)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    report = measure(args.shape, rows, args.iters, args.compile_workers)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.write_table:
        table: dict[str, list] = {}
        for r in report["results"]:
            winner = r["config"] if r["fused_us"] < r["unfused_us"] else None
            table.setdefault(f"{r['out']}x{r['in']}", []).append([r["rows"], winner])
        Path(args.write_table).write_text(json.dumps({report["device"]: table}, indent=1))
        print(f"table for {report['device']}: {json.dumps(table)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
