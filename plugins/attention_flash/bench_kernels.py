"""Micro-benchmarks of the paged-attention kernels: ``triton`` (ours), ``flash_attn`` (flash-attn-4), ``torch``.

Decode: batch 1 / 32 / 256 x context 512 / 1024 / 4096, and seven 20k-token documents among 80 1k-token turns
(and each part alone). Prefill: a 16k-token ragged batch (16 prompts of about 1k tokens) and chunked prefills over
a cached context. 16 query / 8 KV heads, head_dim 128, bfloat16, block size
256 by default (see ``--help``). ``triton_fp8`` is the triton backend on an FP8 cache (``kv_cache_dtype =
"fp8"``: e4m3 values, a float32 scale per token and KV head) holding the same context. Timings are
``triton.testing.do_bench`` medians of the attention alone (the step's keys/values are stored beforehand),
replayed from a CUDA graph where the backend can be captured, as the engine replays its steps, so the host's
launch costs do not count; ``torch`` runs only the small cases (it loops over sequences).

Effective bandwidth counts the bytes a kernel must move at least once: the whole context's K and V plus q and
the output. TFLOP/s counts 4 * head_dim flops per (query head, visible key) pair.

    python plugins/attention_flash/bench_kernels.py --out /tmp/kernels.md
    python plugins/attention_flash/bench_kernels.py --sweep      # also try other triton decode/prefill tiles
    python plugins/attention_flash/bench_kernels.py --sweep prefill --backends triton,flash_attn  # that sweep alone
    python plugins/attention_flash/bench_kernels.py --sweep decode --kv-cache-dtype fp8  # decode tiles, FP8 cache

The prefill sweep times each tile configuration of ``prefill_sweep_configs`` (both K/V load paths: pointers and
TMA) on the four prefill cases and ends with a table of every configuration beside flash-attn-4.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from nanovllm_attention_flash import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from nanovllm_attention_flash.testing import PagedCase, make_case

BACKENDS = {
    "triton": TritonAttentionBackend,
    "triton_fp8": TritonAttentionBackend,
    "flash_attn": FlashAttnBackend,
    "torch": TorchAttentionBackend,
}
FP8 = {"triton_fp8"}  # these names run on an FP8 copy of the case's cache


@dataclass
class Row:
    section: str
    case: str
    backend: str
    us: float
    gbps: float
    tflops: float
    note: str = ""


def bench_us(fn: Callable[[], object]) -> float:
    if not torch.cuda.is_available():  # --smoke on CPU: one timed call of the interpreted kernels
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def attend_fn(backend, case: PagedCase, cache: torch.Tensor) -> Callable[[], object]:
    """A closure running only the attention (keys/values of the step stored once, here)."""
    metadata = backend.build_metadata(case.batch)
    backend.forward(case.q, case.k, case.v, cache, metadata)
    if hasattr(backend, "attend"):
        fn = lambda: backend.attend(case.q, cache, metadata)  # noqa: E731
    else:
        fn = lambda: backend.forward(case.q, case.k, case.v, cache, metadata)  # noqa: E731
    capturable = backend.supports_cuda_graph and (case.batch.max_query_len <= 1 or backend.supports_cuda_graph_mixed)
    if not (case.q.is_cuda and capturable):
        return fn
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_case(batch: int, context: int | tuple[int, int], args, seed: int = 0) -> PagedCase:
    """``batch`` one-token queries over ``context`` tokens each, or over lengths drawn from a ``(low, high)``."""
    if isinstance(context, tuple):
        rnd = random.Random(seed)
        contexts = [rnd.randint(*context) - 1 for _ in range(batch)]
    else:
        contexts = [context - 1] * batch
    return make_case([1] * batch, contexts, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype, device=args.device,
                     unused_fill=0.0, seed=seed)


def long_context_decode_cases(args) -> dict[str, PagedCase]:
    """A few long documents decoding among many chat turns (a server's batch), and each part alone: the batch
    should take about as long as its parts, whose bytes it reads."""
    common = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                  block_size=args.block_size, dtype=args.dtype, device=args.device, unused_fill=0.0)
    parts = {"80 x 1k": [1024] * 80, "7 x 20k": [20480] * 7}
    cases = {"80 x 1k + 7 x 20k": parts["80 x 1k"] + parts["7 x 20k"], **parts}
    return {f"B={len(lens)}: {label}": make_case([1] * len(lens), [n - 1 for n in lens], **common)
            for label, lens in cases.items()}


def prefill_cases(args) -> dict[str, PagedCase]:
    rnd = random.Random(0)
    common = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                  block_size=args.block_size, dtype=args.dtype, device=args.device, unused_fill=0.0)
    ragged = [rnd.randint(768, 1280) for _ in range(16)]
    ragged[-1] += 16384 - sum(ragged)
    long_ragged = [rnd.randint(100, 4096) for _ in range(8)]
    return {
        f"16 prompts, {sum(ragged)} tokens": make_case(ragged, **common),
        f"8 prompts 100..4096, {sum(long_ragged)} tokens": make_case(long_ragged, **common),
        "16 chunks of 1024 over 2048 cached": make_case([1024] * 16, [2048] * 16, **common),
        "4 chunks of 2048 over 8192 cached": make_case([2048] * 4, [8192] * 4, **common),
        # a long document's chunks: a full one, and the short last one (few query tiles over a long context)
        "a chunk of 2048 over 20480 cached": make_case([2048], [20480], **common),
        "a chunk of 256 over 22528 cached": make_case([256], [22528], **common),
    }


def available(name: str, args) -> str | None:
    cls = BACKENDS[name]
    reason = cls.check_available(torch.device(args.device), args.dtype, args.head_dim)
    if reason is None and cls.supported_block_sizes() and args.block_size not in cls.supported_block_sizes():
        reason = f"block size {args.block_size} unsupported"
    if reason is None and name in FP8:
        reason = cls.check_kv_cache_dtype("fp8", torch.device(args.device))
    return reason


def measure(section: str, label: str, case: PagedCase, names: list[str], rows: list[Row], **options) -> None:
    """Time each backend on ``case``; ``options`` go to the triton backends (``triton``, ``triton_fp8``)."""
    for name in names:
        run_case = case.fp8() if name in FP8 else case
        backend = run_case.backend(BACKENDS[name], **(options if BACKENDS[name] is TritonAttentionBackend else {}))
        cache = run_case.kv_cache.clone()
        us = bench_us(attend_fn(backend, run_case, cache))
        del cache
        gbps = (run_case.kv_bytes_read() + run_case.qo_bytes()) / (us * 1e-6) / 1e9
        tflops = run_case.causal_flops() / (us * 1e-6) / 1e12
        del run_case
        rows.append(Row(section, label, name, us, gbps, tflops))
        print(f"  {section:8s} {label:40s} {name:10s} {us:10.1f} us {gbps:8.0f} GB/s {tflops:7.1f} TFLOP/s", flush=True)


def run_smoke(args, names: list[str]) -> list[Row]:
    """Tiny shapes: checks that the script runs (on CPU through Triton's interpreter); timings are meaningless."""
    rows: list[Row] = []
    measure("decode", "B=2 ctx=40", decode_case(2, 40, args), names, rows)
    common = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                  block_size=args.block_size, dtype=args.dtype, device=args.device, unused_fill=0.0)
    measure("prefill", "2 chunks of 20 over 17 cached", make_case([20, 20], [17, 17], **common), names, rows)
    return rows


def run_main(args, names: list[str]) -> list[Row]:
    rows: list[Row] = []
    for batch in (1, 32, 256):
        for context in (512, 1024, 4096):
            case = decode_case(batch, context, args)
            small = batch * context <= 32 * 1024
            use = [n for n in names if n != "torch" or small]
            measure("decode", f"B={batch} ctx={context}", case, use, rows)
            del case
            torch.cuda.empty_cache()
    for label, case in long_context_decode_cases(args).items():
        measure("decode", label, case, [n for n in names if n != "torch"], rows)
        del case
        torch.cuda.empty_cache()
    for label, case in prefill_cases(args).items():
        use = [n for n in names if n != "torch" or case.batch.num_tokens <= 4096]
        measure("prefill", label, case, use, rows)
        del case
        torch.cuda.empty_cache()
    return rows


def sweep_backend(args) -> str:
    """The triton flavour the sweeps tune: ``triton``, or ``triton_fp8`` with ``--kv-cache-dtype fp8``."""
    return "triton_fp8" if args.kv_cache_dtype == "fp8" else "triton"


def run_decode_sweep(args) -> list[Row]:
    """Other decode tiles / split counts of the triton backend (to tune the defaults)."""
    rows: list[Row] = []
    decode_tiles = [(64, 4, 3), (64, 4, 5), (32, 4, 3), (32, 4, 5), (128, 4, 3), (128, 8, 3), (64, 8, 3), (128, 8, 5)]
    cases: list[tuple[int, int | tuple[int, int]]] = [(256, 1024), (32, 1024), (1, 4096)]
    if args.kv_cache_dtype == "fp8":  # fewer warps a program: more programs an SM, on ragged contexts
        decode_tiles = [(32, 1, 3), (32, 1, 2), (32, 1, 4), (32, 2, 3), (64, 2, 2), (64, 4, 3)]
        cases = [(256, 1024), (256, (100, 1500)), (64, (100, 2000))]
    for batch, context in cases:
        case = decode_case(batch, context, args)
        if isinstance(context, tuple):  # contexts drawn from this range: a batch as the engine sees it
            context = f"{context[0]}..{context[1]}"
        for block_n, warps, stages in decode_tiles:
            if args.block_size % block_n:
                continue
            for splits in (None, 1, 2, 4, 8, 16):
                opts = dict(decode_block_n=block_n, decode_num_warps=warps, decode_num_stages=stages)
                if splits is not None:
                    opts["num_kv_splits"] = splits
                tag = f"n{block_n} w{warps} s{stages} splits={'auto' if splits is None else splits}"
                try:
                    measure("sweep-d", f"B={batch} ctx={context} {tag}", case, [sweep_backend(args)], rows, **opts)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report it, go on
                    print(f"  sweep-d B={batch} ctx={context} {tag}: {type(exc).__name__}: {exc}", flush=True)
                    break  # the other split counts of this tile fail the same way
        del case
        torch.cuda.empty_cache()
    return rows


SMEM_PER_BLOCK = 227 * 1024  # the most shared memory one thread block may use on an H100/H200 (sm_90)


def prefill_sweep_configs(head_dim: int, block_size: int, dtype: torch.dtype) -> list:
    """The prefill tiles the sweep times: pointer and TMA K/V loads x BLOCK_M {64, 128} x BLOCK_N {32, 64, 128}
    x num_stages {2, 3, 4} x num_warps {4, 8}, pruned to what can win on Hopper (a wgmma covers 64 query rows
    per warpgroup of 4 warps):

    - BLOCK_M 64 runs on 4 warps and BLOCK_M 128 on 8 (one warpgroup per 64 rows). BLOCK_M 128 on 4 warps
      spills registers at every BLOCK_N (ptxas for sm_90, head_dim 128: the 128 x 128 fp32 accumulator alone
      takes 128 registers a thread), and BLOCK_M 64 on 8 warps splits each row's softmax across two warpgroups
      (Triton's fused-attention tutorial skips 8 warps for tiles under 128 x 128 on Hopper);
    - BLOCK_M 64 stops at BLOCK_N 64 (it spills at 128); BLOCK_N is capped at the cache block size;
    - the Q tile and ``num_stages`` K and V tiles fit in a block's shared memory.

    For head_dim 128, bfloat16 and 256-token blocks: 14 tiles per load path, 28 in all.
    """
    from nanovllm_attention_flash.triton_kernels import PrefillConfig

    itemsize = torch.empty((), dtype=dtype).element_size()
    configs = []
    for use_tma in (False, True):
        for block_m, num_warps, block_ns in ((64, 4, (32, 64)), (128, 8, (32, 64, 128))):
            for block_n in sorted({min(n, block_size) for n in block_ns}):
                for stages in (2, 3, 4):
                    if (block_m + 2 * stages * block_n) * head_dim * itemsize > SMEM_PER_BLOCK:
                        continue
                    configs.append(PrefillConfig(block_m, block_n, num_warps, stages, use_tma))
    return configs


def tile_tag(cfg) -> str:
    return f"{'tma' if cfg.use_tma else 'ptr'} m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"


def tile_options(cfg) -> dict:
    return dict(prefill_block_m=cfg.block_m, prefill_block_n=cfg.block_n, prefill_num_warps=cfg.num_warps,
                prefill_num_stages=cfg.num_stages, prefill_use_tma=cfg.use_tma)


def precompile_prefill(case: PagedCase, configs: list) -> None:
    """Compile the prefill kernel for every config on a thread pool before timing (the compiler releases the GIL
    for most of its work): a few times faster than compiling one config after the other. Compile errors are
    left for the timed run to report; without Triton's async-compile mode, each config compiles when first run."""
    if not torch.cuda.is_available():
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    from nanovllm_attention_flash import triton_kernels

    start = time.perf_counter()
    b, cache, out = case.batch, case.kv_cache, torch.empty_like(case.q)  # only shapes and types matter here
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for cfg in configs:
            try:
                triton_kernels.prefill_attention(case.q, cache[0], cache[1], b.block_tables, b.seq_lens,
                                                 b.query_start_loc, out, case.scale, b.num_seqs, cfg, warmup=True)
            except Exception:  # noqa: BLE001 - reported by the timed run
                pass
    print(f"  compiled {len(configs)} prefill configs on {workers} threads in {time.perf_counter() - start:.1f} s",
          flush=True)


def run_prefill_sweep(args, names: list[str]) -> tuple[list[Row], str]:
    """Every tile of ``prefill_sweep_configs`` (tiny ones with ``--smoke``) on the four prefill cases, flash-attn-4
    beside them; a config that fails (out of shared memory, a compile error) is reported and skipped."""
    from nanovllm_attention_flash.triton_kernels import PrefillConfig, default_prefill_config

    if args.smoke:
        common = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                      block_size=args.block_size, dtype=args.dtype, device=args.device, unused_fill=0.0)
        cases = {"2 chunks of 20 over 17 cached": make_case([20, 20], [17, 17], **common)}
        default = PrefillConfig(16, 16, 4, 2)
        configs = [default, PrefillConfig(16, 16, 4, 2, use_tma=True), PrefillConfig(16, 2 * args.block_size, 4, 2)]
    else:
        cases = dict(list(prefill_cases(args).items())[:4])
        default = default_prefill_config(args.head_dim, args.block_size)
        configs = prefill_sweep_configs(args.head_dim, args.block_size, args.dtype)
        if default not in configs:
            configs.insert(0, default)
    print(f"prefill sweep ({sweep_backend(args)}): {len(configs)} configs x {len(cases)} cases", flush=True)
    if sweep_backend(args) == "triton":  # FP8 configs compile when first timed
        precompile_prefill(next(iter(cases.values())), configs)
    rows: list[Row] = []
    times: dict[tuple[str, str], float] = {}
    reference: dict[str, float] = {}
    failed: dict[str, str] = {}
    for label, case in cases.items():
        if "flash_attn" in names:
            try:
                measure("sweep-p", label, case, ["flash_attn"], rows)
                reference[label] = rows[-1].us
            except Exception as exc:  # noqa: BLE001 - the table is still useful without it
                print(f"  sweep-p {label} flash_attn: {type(exc).__name__}: {exc}")
        for cfg in configs:
            tag = tile_tag(cfg)
            if tag in failed:
                continue
            try:
                measure("sweep-p", f"{label} {tag}", case, [sweep_backend(args)], rows, **tile_options(cfg))
                times[(label, tag)] = rows[-1].us
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory, a compile error
                failed[tag] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc) else ''}"
                print(f"  sweep-p {label} {tag}: {failed[tag]}", flush=True)
        del case
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows, prefill_sweep_table(list(cases), configs, tile_tag(default), times, reference, failed,
                                     sweep_backend(args))


def prefill_sweep_table(labels: list[str], configs: list, default_tag: str, times: dict[tuple[str, str], float],
                        reference: dict[str, float], failed: dict[str, str], backend: str = "triton") -> str:
    """Markdown: one row per config (fastest first by geometric mean over the cases, relative to the default
    config), one column per case with its time and, in brackets, flash-attn-4's time / this."""
    def speedup(tag: str) -> float | None:  # geometric mean of default time / this time
        ratios = [times[(c, default_tag)] / times[(c, tag)] for c in labels if (c, tag) in times and (c, default_tag)
                  in times]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None

    tags = [tile_tag(cfg) for cfg in configs if tile_tag(cfg) not in failed]
    tags.sort(key=lambda t: -(speedup(t) or 0.0))
    lines = [f"## Prefill tile sweep ({backend})", "",
             "Time in us; in brackets: flash_attn time / this (1.00 = as fast as flash-attn-4). Last column: "
             f"geometric-mean speed-up over the default config ({default_tag}).", "",
             "| config | " + " | ".join(labels) + " | vs default |",
             "|---|" + "---:|" * (len(labels) + 1)]
    if reference:
        lines.append("| flash_attn | " + " | ".join(f"{reference[c]:.1f}" if c in reference else "" for c in labels)
                     + " | |")
    for tag in tags:
        cells = []
        for c in labels:
            us = times.get((c, tag))
            cells.append("" if us is None else f"{us:.1f}" + (f" ({reference[c] / us:.2f})" if c in reference else ""))
        gain = speedup(tag)
        name = f"{tag} (default)" if tag == default_tag else tag
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'' if gain is None else f'{gain:.3f}'} |")
    lines.append("")
    lines += [f"- {tag} failed: {error}" for tag, error in failed.items()]
    best = []
    for c in labels:
        measured = [(times[(c, t)], t) for t in tags if (c, t) in times]
        if measured:
            us, tag = min(measured)
            vs = f", flash_attn / this {reference[c] / us:.2f}" if c in reference else ""
            best.append(f"- best for {c}: {tag}, {us:.1f} us{vs}")
    return "\n".join(lines + best) + "\n"


def run_sweep(args, names: list[str], what: str = "all") -> tuple[list[Row], str]:
    """The decode sweep and/or the prefill sweep (``what``: all, decode, prefill); the prefill sweep's table."""
    rows: list[Row] = []
    text = ""
    if what in ("all", "decode") and not args.smoke:
        rows += run_decode_sweep(args)
    if what in ("all", "prefill"):
        prefill_rows, text = run_prefill_sweep(args, names)
        rows += prefill_rows
    return rows, text


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"


def markdown(rows: list[Row], args, skipped: dict[str, str]) -> str:
    lines = [
        f"# Paged attention kernels on {device_name()}",
        "",
        f"{args.num_heads} query / {args.num_kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{str(args.dtype).removeprefix('torch.')}, block size {args.block_size}; median of "
        "`triton.testing.do_bench`, attention only (keys/values stored beforehand).",
        "",
    ]
    for name, reason in skipped.items():
        lines.append(f"- `{name}` not measured: {reason}")
    if skipped:
        lines.append("")
    ref = {(r.section, r.case): r.us for r in rows if r.backend == "flash_attn"}
    lines += ["| kernel | case | backend | time (us) | eff. GB/s | TFLOP/s | flash_attn time / this |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{ref[(r.section, r.case)] / r.us:.2f}" if (r.section, r.case) in ref else ""
        lines.append(f"| {r.section} | {r.case} | {r.backend} | {r.us:.1f} | {r.gbps:.0f} | {r.tflops:.1f} | {vs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the results as a markdown table here")
    parser.add_argument("--backends", default="triton,triton_fp8,flash_attn,torch", help="comma-separated subset")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the cache the --sweep tunes the triton kernels on (the main tables run both)")
    parser.add_argument("--sweep", nargs="?", const="all", choices=["all", "decode", "prefill"],
                        help="also sweep triton tile configurations; `--sweep decode` / `--sweep prefill`: that sweep "
                        "alone, without the main tables (with --smoke: a tiny prefill sweep)")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes only, to check the script (runs on CPU with TRITON_INTERPRET=1 too)")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.smoke:
        print("bench_kernels.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 1
    if args.smoke:
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size = 4, 2, 64, 16
        if args.device == "cpu":
            args.dtype = torch.float32
    names, skipped = [], {}
    for name in args.backends.split(","):
        reason = available(name, args)
        if reason is None:
            names.append(name)
        else:
            skipped[name] = reason
            print(f"skipping {name}: {reason}")
    if "triton" in skipped and "triton" in args.backends:
        print("triton is needed for the timings (do_bench) and the KV store", file=sys.stderr)
        return 1
    print(f"{device_name()}: {names}")
    rows: list[Row] = []
    if args.sweep in (None, "all"):
        rows += run_smoke(args, names) if args.smoke else run_main(args, names)
    sweep_text = ""
    if args.sweep:
        sweep_rows, sweep_text = run_sweep(args, names, args.sweep)
        rows += sweep_rows
    text = markdown(rows, args, skipped)
    print()
    print(text)
    if sweep_text:  # last, so the tail of the log shows it
        print(sweep_text)
        text += "\n" + sweep_text
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
