"""How fast the decode step's projections read their weights: each layer's GEMM at the batch sizes decode meets.

    python benchmarks/decode_gemm.py [--shape qwen3-0.6b] [--rows 1,16,64,128,256,512] [--blas default,cublaslt]
                                     [--skinny] [--sweep] [--norm] [--fp8 [--fp8-config JSON]] [--iters 50]
                                     [--json PATH] [--results-dir results]

A decode step multiplies ``rows`` activations (one per running sequence) by every weight matrix once: at small
``rows`` the step should stream the weights at the copy rate. For each projection of the shape (``qkv``, ``o``,
``gate_up``, ``down`` and ``lm_head``, as the engine's fused layers hold them, unsharded) and each row count this
times ``F.linear`` in bf16 (``--iters`` calls captured in a CUDA graph, as the engine replays a decode step; CUDA
events bracketing 5 replays, the median per call; each call takes the next of enough copies of the matrix to outgrow
the L2 cache, as the layers of a step do)
and reports microseconds, TFLOP/s and the weights' read rate in TB/s against the device's copy rate (the
``nanovllm bench`` bound's). ``--blas`` names PyTorch's BLAS back-ends to compare
(``torch.backends.cuda.preferred_blas_library``); ``--skinny`` adds the engine's kernel for a few rows
(``nanovllm_core.layers.skinny_gemm_kernel``, rows up to its ``MAX_ROWS``) as the ``skinny`` row, and ``--sweep``
times every block configuration of it instead of its default one, printing the fastest per layer and row count
(how ``launch_config`` is chosen). ``--norm`` times the residual add and RMSNorm before the ``qkv`` and ``gate_up``
projections in the skinny kernel's prologue (``skinny_norm_linear``, ``norm`` = ``prologue``) against
``rms_norm_kernel`` then the skinny kernel (``norm`` = ``separate``), gate-up with its SiLU in both; with
``--fp8`` the same for the FP8 weight-only kernel (``w8a16_norm_linear``, gate-up's SiLU-and-mul in its epilogue,
against ``rms_norm_kernel``, ``w8a16_linear`` and ``silu_and_mul_kernel``; for gate-up also the norm's kernel, then
the product with the SiLU-and-mul in its epilogue, ``norm`` = ``epilogue``, and the norm alone in its launch,
``norm-only``). At a few rows a
GEMM's fixed latency, not its bytes, can set its time: this says, layer by layer, how far each projection is from
reading its weights at the copy rate. ``--fp8`` adds nanovllm-quant-fp8's products of the same layers with e4m3
weights: its weight-only kernel for a few rows (``w8a16-channel``, and ``w8a16-block`` with Qwen's 128 x 128 block
scales; ``--sweep`` times every configuration of it instead of the skinny kernel's, ``--fp8-config`` changes its
launch settings, e.g. ``'{"LATE_SUM": false}'``) and, for any row count, the
activation quantization followed by the FP8 GEMM (``w8a8-channel``: ``torch._scaled_mm``; ``w8a8-fastacc``: the
same with ``use_fast_accum``; ``quantize``: the activations' quantization alone; ``w8a8-block``: the
plugin's block-scaled Triton kernel); the weights' read rate counts their FP8 bytes. On a machine without CUDA it
runs on the CPU with ``--rows`` as given, the FP8 kernels in Triton's interpreter (a check of the script, not a
measurement of interest). Without ``--json`` the report goes to
RESULTS_DIR/kernels/decode_gemm_SHAPE.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from _common import copy_bytes_per_s, out_dir, write_json
from nanovllm_bench.offline import SHAPES


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


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], iters: int, fn: Any = F.linear) -> float:
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


SWEEP = [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
    for n in (1, 2, 4, 8, 16, 32)
    for k in (256, 512, 1024, 2048)
    for w in (2, 4, 8)
]


def skinny_configs(m: int, n: int, k: int, sweep: bool) -> list[dict[str, int]]:
    from nanovllm_core.layers.skinny_gemm_kernel import launch_config

    default = launch_config(m, n, k)
    if not sweep:
        return [default]
    fits = [
        dict(c, M_PAD=default["M_PAD"])
        for c in SWEEP
        if default["M_PAD"] * c["BLOCK_N"] * c["BLOCK_K"] <= 32768  # products a program holds
    ]
    return [c for c in fits if c["BLOCK_K"] <= max(256, k)]


def cold_copies(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """Copies of one random ``[n, k]`` weight that together outgrow the L2 cache (one on a CPU), and its bytes."""
    w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
    weight_bytes = w.numel() * w.element_size()
    copies = min(64, -(-COLD_BYTES // weight_bytes)) if device.type == "cuda" else 1
    return [w] + [w.clone() for _ in range(copies - 1)], weight_bytes


def result_row(
    blas: str, layer: str, m: int, k: int, n: int, seconds: float, weight_bytes: int, **extra: Any
) -> dict[str, Any]:
    return {
        "blas": blas, "layer": layer, "rows": m, "in": k, "out": n, "us": seconds * 1e6,
        "tflops": 2 * m * k * n / seconds / 1e12, "weight_tb_per_s": weight_bytes / seconds / 1e12, **extra,
    }  # fmt: skip


def measure(
    shape_name: str,
    rows: list[int],
    blas: list[str],
    iters: int,
    skinny: bool = False,
    sweep: bool = False,
    norm: bool = False,
    fp8: bool = False,
    fp8_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_rate = copy_bytes_per_s() if device.type == "cuda" else None
    results = []
    for backend in blas if device.type == "cuda" else ["default"]:
        if device.type == "cuda" and backend != "default":
            torch.backends.cuda.preferred_blas_library(backend)
        for name, (k, n) in projections(SHAPES[shape_name]).items():
            weights, weight_bytes = cold_copies(n, k, device, dtype)
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device=device)
                seconds = time_linear(x, weights, iters)
                results.append(result_row(backend, name, m, k, n, seconds, weight_bytes))
            del weights
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("default")
    if skinny or (sweep and not fp8):
        results += measure_skinny(shape_name, rows, iters, sweep, device, dtype)
    if norm:
        results += measure_norm(shape_name, rows, iters, device, dtype)
    if fp8:
        results += measure_fp8(shape_name, rows, iters, sweep, device, dtype, fp8_config)
    if fp8 and norm:
        results += measure_fp8_norm(shape_name, rows, iters, device)
    return {
        "shape": shape_name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "copy_tb_per_s": copy_rate / 1e12 if copy_rate else None,
        "results": results,
    }


def measure_skinny(
    shape_name: str, rows: list[int], iters: int, sweep: bool, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """The skinny kernel's rows (``blas`` = ``skinny``): its default configuration, or with ``sweep`` the fastest
    of every configuration (named in ``config``)."""
    from nanovllm_core.layers.skinny_gemm_kernel import MAX_ROWS, skinny_linear

    results = []
    for name, (k, n) in projections(SHAPES[shape_name]).items():
        weights, weight_bytes = cold_copies(n, k, device, dtype)
        for m in (r for r in rows if r <= MAX_ROWS):
            x = torch.randn(m, k, dtype=dtype, device=device)
            timed = []
            for config in skinny_configs(m, n, k, sweep):
                fn = functools.partial(skinny_linear, config=config)
                timed.append((time_linear(x, weights, iters if device.type == "cuda" else 1, fn), config))
            seconds, config = min(timed, key=lambda t: t[0])
            results.append(result_row("skinny", name, m, k, n, seconds, weight_bytes, config=config))
        del weights
    return results


NORMED = ("qkv", "gate_up")  # the projections a decoder layer's RMSNorm precedes


def _norm_in_prologue(x, w, norm_weight, residual, silu_mul):
    from nanovllm_core.layers.skinny_gemm_kernel import skinny_norm_linear

    return skinny_norm_linear(x, w, norm_weight, 1e-6, residual, silu_mul=silu_mul)


def _norm_then_gemm(x, w, norm_weight, residual, silu_mul):
    from nanovllm_core.layers.rms_norm_kernel import rms_norm
    from nanovllm_core.layers.skinny_gemm_kernel import skinny_linear

    h, residual = rms_norm(x, norm_weight, 1e-6, residual)
    return skinny_linear(h, w, silu_mul=silu_mul), residual


def measure_norm(
    shape_name: str, rows: list[int], iters: int, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """The add + RMSNorm and the projection after it (``blas`` = ``skinny``), in one kernel (``norm`` =
    ``prologue``) and in two (``separate``)."""
    from nanovllm_core.layers.skinny_gemm_kernel import MAX_ROWS

    results = []
    for name, (k, n) in projections(SHAPES[shape_name]).items():
        if name not in NORMED:
            continue
        weights, weight_bytes = cold_copies(n, k, device, dtype)
        norm_weight = torch.ones(k, dtype=dtype, device=device)
        for m in (r for r in rows if r <= MAX_ROWS):
            x, residual = torch.randn(2, m, k, dtype=dtype, device=device)
            for norm, fn in (("prologue", _norm_in_prologue), ("separate", _norm_then_gemm)):
                fn = functools.partial(fn, norm_weight=norm_weight, residual=residual, silu_mul=name == "gate_up")
                seconds = time_linear(x, weights, iters if device.type == "cuda" else 1, fn)
                results.append(result_row("skinny", name, m, k, n, seconds, weight_bytes, norm=norm))
        del weights
    return results


FP8_BLOCK = (128, 128)  # Qwen's FP8 releases
FP8_SWEEP = [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
    for n in (2, 4, 8, 16, 32, 64)
    for k in (64, 128, 256, 512, 1024)
    for w in (2, 4, 8)
    for st in (4,)
]


def fp8_configs(
    m: int, n: int, k: int, block: tuple[int, int] | None, sweep: bool, override: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    from nanovllm_quant_fp8.kernels import w8a16_config

    default = dict(w8a16_config(m, n, k, block), **(override or {}))
    if not sweep:
        return [default]
    found = []
    for c in FP8_SWEEP:
        config = dict(default, **c)
        if default["USE_DOT"]:
            fits = c["BLOCK_N"] >= 16 and c["BLOCK_K"] <= 512 and default["M_PAD"] * c["BLOCK_N"] <= 1024
        else:
            fits = c["BLOCK_K"] >= 128 and default["M_PAD"] * c["BLOCK_N"] * c["BLOCK_K"] <= 32768
        if fits and c["BLOCK_K"] <= max(64, k) and (block is None or block[1] % c["BLOCK_K"] == 0):
            found.append(config)
            if not default["USE_DOT"]:  # the CUDA cores' products summed per chunk, or once at the end
                found.append(dict(config, LATE_SUM=not config.get("LATE_SUM", False)))
    return found


def _w8a8_channel(x, w, scale, fast_accum=False):
    from nanovllm_quant_fp8 import kernels

    xq, x_scale = kernels.quantize_activation(x, None)
    return torch._scaled_mm(
        xq, w.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype, use_fast_accum=fast_accum
    )


def _quantize_only(x, w, scale):
    from nanovllm_quant_fp8 import kernels

    return kernels.quantize_activation(x, None)[0]


def _w8a8_block(x, w, scale):
    from nanovllm_quant_fp8 import kernels

    xq, x_scale = kernels.quantize_activation(x, FP8_BLOCK[1])
    return kernels.w8a8_block_matmul(xq, x_scale, w, scale, FP8_BLOCK, x.dtype)


def _fp8_weight_copies(
    w: torch.Tensor, block: tuple[int, int] | None, cuda: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``w`` quantized to e4m3 (per output channel, or per ``block``) with its scale, and on a GPU enough clones that
    each timed call reads a copy no longer in the cache."""
    from nanovllm_quant_fp8 import fp8

    wq, scale = fp8.quantize_weight_per_channel(w) if block is None else fp8.quantize_weight_blockwise(w, block)
    scale = scale.float().reshape(-1) if block is None else scale.float().contiguous()
    copies = min(64, -(-COLD_BYTES // w.numel())) if cuda else 1  # one byte a weight
    return [(wq, scale)] + [(wq.clone(), scale) for _ in range(copies - 1)]


def measure_fp8(
    shape_name: str,
    rows: list[int],
    iters: int,
    sweep: bool,
    device: torch.device,
    dtype: torch.dtype,
    override: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """nanovllm-quant-fp8's products of each projection with its e4m3 weight (per output channel, and per 128 x 128
    block): ``w8a16-*`` (rows up to the kernel's ``MAX_ROWS``; its default configuration, or with ``sweep`` the
    fastest, named in ``config``) and ``w8a8-*`` (activation quantization + FP8 GEMM, every row count)."""
    from nanovllm_quant_fp8 import kernels

    cuda = device.type == "cuda"
    dtype = torch.bfloat16  # the kernels take 16-bit activations, the CPU's interpreter too
    results = []
    for name, (k, n) in projections(SHAPES[shape_name]).items():
        if name == "lm_head":  # the method leaves it in 16 bits
            continue
        w = torch.randn(n, k, device=device) * 0.02
        weight_bytes = n * k  # one byte a weight
        for block in (None, FP8_BLOCK):
            pairs = _fp8_weight_copies(w, block, cuda)
            kind = "channel" if block is None else "block"
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device=device)
                timed = []
                if m <= kernels.MAX_ROWS:
                    for config in fp8_configs(m, n, k, block, sweep and cuda, override):

                        def w8a16(x, pair, config=config, block=block):
                            return kernels.w8a16_linear(x, pair[0], pair[1], block, config=config)

                        timed.append((time_linear(x, pairs, iters if cuda else 1, w8a16), config))
                    seconds, config = min(timed, key=lambda t: t[0])
                    results.append(result_row(f"w8a16-{kind}", name, m, k, n, seconds, weight_bytes, config=config))
                products = {f"w8a8-{kind}": _w8a8_channel if block is None else _w8a8_block}
                if block is None and cuda:  # the FP8 tensor cores' faster accumulation; the quantization alone
                    products["w8a8-fastacc"] = functools.partial(_w8a8_channel, fast_accum=True)
                    products["quantize"] = _quantize_only
                for label, product in products.items():
                    if not (cuda or m <= 16):  # the interpreter's block GEMM is slow
                        continue

                    def w8a8(x, pair, product=product):
                        return product(x, pair[0], pair[1])

                    seconds = time_linear(x, pairs, iters if cuda else 1, w8a8)
                    results.append(result_row(label, name, m, k, n, seconds, weight_bytes))
            del pairs
    return results


def _fp8_norm_in_kernel(x, pair, norm_weight, residual, silu_mul, block):
    from nanovllm_quant_fp8.kernels import w8a16_norm_linear

    return w8a16_norm_linear(x, pair[0], pair[1], block, norm_weight, 1e-6, residual, silu_mul=silu_mul)


def _fp8_norm_then_gemm(x, pair, norm_weight, residual, silu_mul, block):
    from nanovllm_quant_fp8.kernels import w8a16_linear

    from nanovllm_core.layers.rms_norm_kernel import rms_norm
    from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul

    h, residual = rms_norm(x, norm_weight, 1e-6, residual)
    y = w8a16_linear(h, pair[0], pair[1], block)
    return (silu_and_mul(y) if silu_mul else y), residual


def _fp8_norm_in_kernel_silu_after(x, pair, norm_weight, residual, silu_mul, block):
    from nanovllm_quant_fp8.kernels import w8a16_norm_linear

    from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul

    y, residual = w8a16_norm_linear(x, pair[0], pair[1], block, norm_weight, 1e-6, residual)
    return silu_and_mul(y), residual


def _fp8_silu_in_kernel(x, pair, norm_weight, residual, silu_mul, block):
    from nanovllm_quant_fp8.kernels import w8a16_linear

    from nanovllm_core.layers.rms_norm_kernel import rms_norm

    h, residual = rms_norm(x, norm_weight, 1e-6, residual)
    return w8a16_linear(h, pair[0], pair[1], block, silu_mul=silu_mul), residual


def measure_fp8_norm(shape_name: str, rows: list[int], iters: int, device: torch.device) -> list[dict[str, Any]]:
    """The add + RMSNorm before the ``qkv`` and ``gate_up`` projections and gate-up's SiLU-and-mul, in the FP8
    weight-only kernel's launch (``norm`` = ``prologue``: ``w8a16_norm_linear``), as the core's kernels around
    it (``separate``), and for gate-up the norm's kernel then the product with its SiLU-and-mul (``epilogue``) and
    the product with the norm then the SiLU-and-mul's kernel (``norm-only``), per-channel and block-scaled weights
    (``blas`` = ``w8a16-channel`` / ``w8a16-block``)."""
    from nanovllm_quant_fp8 import kernels

    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    results = []
    for name, (k, n) in projections(SHAPES[shape_name]).items():
        if name not in NORMED:
            continue
        w = torch.randn(n, k, device=device) * 0.02
        norm_weight = torch.ones(k, dtype=dtype, device=device)
        for block in (None, FP8_BLOCK):
            pairs = _fp8_weight_copies(w, block, cuda)
            for m in (r for r in rows if r <= kernels.MAX_ROWS):
                x, residual = torch.randn(2, m, k, dtype=dtype, device=device)
                ways = [("prologue", _fp8_norm_in_kernel), ("separate", _fp8_norm_then_gemm)]
                if name == "gate_up":
                    ways += [("epilogue", _fp8_silu_in_kernel), ("norm-only", _fp8_norm_in_kernel_silu_after)]
                for norm, fn in ways:
                    fn = functools.partial(
                        fn, norm_weight=norm_weight, residual=residual, silu_mul=name == "gate_up", block=block
                    )
                    seconds = time_linear(x, pairs, iters if cuda else 1, fn)
                    label = f"w8a16-{'channel' if block is None else 'block'}"
                    results.append(result_row(label, name, m, k, n, seconds, n * k, norm=norm))
            del pairs
    return results


def print_table(report: dict[str, Any]) -> None:
    copy = report["copy_tb_per_s"]
    print(
        f"{report['shape']} on {report['device']}, {report['dtype']}" + (f", copy rate {copy:.2f} TB/s" if copy else "")
    )
    print(f"{'blas':13} {'layer':8} {'in x out':>14} {'rows':>5} {'us':>9} {'TFLOP/s':>8} {'weights TB/s':>13}")
    for r in report["results"]:
        share = f" ({100 * r['weight_tb_per_s'] / copy:.0f}%)" if copy else ""
        print(
            f"{r['blas']:13} {r['layer']:8} {r['in']:>6} x {r['out']:<6} {r['rows']:>5} {r['us']:>9.1f} "
            f"{r['tflops']:>8.1f} {r['weight_tb_per_s']:>7.2f}{share}"
            + (f"  {r['config']}" if "config" in r else "")
            + (f"  norm {r['norm']}" if "norm" in r else "")
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--rows", default="1,16,64,128,256,512", help="comma-separated batch sizes (rows)")
    parser.add_argument("--blas", default="default,cublaslt", help="comma-separated BLAS back-ends to compare")
    parser.add_argument("--skinny", action="store_true", help="also time the engine's kernel for a few rows")
    parser.add_argument("--sweep", action="store_true", help="time every block configuration of the few-row kernels")
    parser.add_argument(
        "--norm",
        action="store_true",
        help="time the add + RMSNorm in that kernel's prologue against a kernel before it (with --fp8: in the FP8 "
        "weight-only kernel's too)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="also time nanovllm-quant-fp8's products with e4m3 weights (with --sweep: every configuration of its "
        "few-row kernel)",
    )
    parser.add_argument(
        "--fp8-config",
        type=json.loads,
        metavar="JSON",
        help='with --fp8: launch settings of the few-row kernel to change from its default, e.g. \'{"LATE_SUM": '
        "false}' (the rest as w8a16_config gives them; with --sweep, the configurations swept start from these)",
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="write the report here ('-': stdout; default: in --results-dir)")
    parser.add_argument(
        "--results-dir", default="results", help="without --json: RESULTS_DIR/kernels/ (default results)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: comma-separated positive integers, e.g. 1,64,256")
    if not rows or min(rows) < 1:
        parser.error(f"--rows {args.rows!r}: comma-separated positive integers, e.g. 1,64,256")
    blas = [b.strip() for b in args.blas.split(",") if b.strip()]
    if args.fp8_config is not None and not (args.fp8 and isinstance(args.fp8_config, dict)):
        parser.error(f"--fp8-config {args.fp8_config!r}: a JSON object of launch settings, with --fp8")
    report = measure(
        args.shape, rows, blas, args.iters, skinny=args.skinny, sweep=args.sweep, norm=args.norm, fp8=args.fp8,
        fp8_config=args.fp8_config,
    )  # fmt: skip
    print_table(report)
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    else:
        write_json(out_dir(args.results_dir, "kernels") / f"decode_gemm_{args.shape}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
