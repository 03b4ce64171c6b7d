"""Micro-benchmarks of the paged-attention kernels: ``triton`` (ours), ``flash_attn`` (flash-attn-4), ``torch``.

Decode: batch 1 / 32 / 256 x context 512 / 1024 / 4096. Prefill: a 16k-token ragged batch (16 prompts of about
1k tokens) and chunked prefills over a cached context. 16 query / 8 KV heads, head_dim 128, bfloat16, block size
256 by default (see ``--help``). Timings are ``triton.testing.do_bench`` medians of the attention alone (the
step's keys/values are stored beforehand); ``torch`` runs only the small cases (it loops over sequences).

Effective bandwidth counts the bytes a kernel must move at least once: the whole context's K and V plus q and
the output. TFLOP/s counts 4 * head_dim flops per (query head, visible key) pair.

    python plugins/attention_flash/bench_kernels.py --out /tmp/kernels.md
    python plugins/attention_flash/bench_kernels.py --sweep      # also try other triton decode/prefill tiles
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from nanovllm_attention_flash import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from nanovllm_attention_flash.testing import PagedCase, make_case

BACKENDS = {"triton": TritonAttentionBackend, "flash_attn": FlashAttnBackend, "torch": TorchAttentionBackend}


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
        return lambda: backend.attend(case.q, cache, metadata)
    return lambda: backend.forward(case.q, case.k, case.v, cache, metadata)


def decode_case(batch: int, context: int, args, seed: int = 0) -> PagedCase:
    return make_case([1] * batch, [context - 1] * batch, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype, device=args.device,
                     unused_fill=0.0, seed=seed)


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
    }


def available(name: str, args) -> str | None:
    cls = BACKENDS[name]
    reason = cls.check_available(torch.device(args.device), args.dtype, args.head_dim)
    if reason is None and cls.supported_block_sizes() and args.block_size not in cls.supported_block_sizes():
        reason = f"block size {args.block_size} unsupported"
    return reason


def measure(section: str, label: str, case: PagedCase, names: list[str], rows: list[Row], **options) -> None:
    for name in names:
        backend = case.backend(BACKENDS[name], **(options if name == "triton" else {}))
        cache = case.kv_cache.clone()
        us = bench_us(attend_fn(backend, case, cache))
        del cache
        gbps = (case.kv_bytes_read() + case.qo_bytes()) / (us * 1e-6) / 1e9
        tflops = case.causal_flops() / (us * 1e-6) / 1e12
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
    for label, case in prefill_cases(args).items():
        use = [n for n in names if n != "torch" or case.batch.num_tokens <= 4096]
        measure("prefill", label, case, use, rows)
        del case
        torch.cuda.empty_cache()
    return rows


def run_sweep(args) -> list[Row]:
    """Other decode tiles / split counts and prefill tiles of the triton backend (to tune the defaults)."""
    rows: list[Row] = []
    decode_tiles = [(64, 4, 3), (64, 4, 5), (32, 4, 3), (32, 4, 5), (128, 4, 3), (128, 8, 3), (64, 8, 3), (128, 8, 5)]
    for batch, context in ((256, 1024), (32, 1024), (1, 4096)):
        case = decode_case(batch, context, args)
        for block_n, warps, stages in decode_tiles:
            if args.block_size % block_n:
                continue
            for splits in (None, 1, 2, 4, 8, 16):
                opts = dict(decode_block_n=block_n, decode_num_warps=warps, decode_num_stages=stages)
                if splits is not None:
                    opts["num_kv_splits"] = splits
                tag = f"n{block_n} w{warps} s{stages} splits={'auto' if splits is None else splits}"
                measure("sweep-d", f"B={batch} ctx={context} {tag}", case, ["triton"], rows, **opts)
        del case
        torch.cuda.empty_cache()
    prefill_tiles = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                     (128, 64, 4, 3)]
    for label, case in list(prefill_cases(args).items())[:3]:
        for block_m, block_n, warps, stages in prefill_tiles:
            if args.block_size % block_n:
                continue
            opts = dict(prefill_block_m=block_m, prefill_block_n=block_n, prefill_num_warps=warps,
                        prefill_num_stages=stages)
            try:
                measure("sweep-p", f"{label} m{block_m} n{block_n} w{warps} s{stages}", case, ["triton"], rows, **opts)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory
                print(f"  sweep-p {label} m{block_m} n{block_n} w{warps} s{stages}: {type(exc).__name__}: {exc}")
        del case
        torch.cuda.empty_cache()
    return rows


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
    parser.add_argument("--backends", default="triton,flash_attn,torch", help="comma-separated subset")
    parser.add_argument("--sweep", action="store_true", help="also sweep triton tile configurations")
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
    rows = run_smoke(args, names) if args.smoke else run_main(args, names)
    if args.sweep and not args.smoke:
        rows += run_sweep(args)
    text = markdown(rows, args, skipped)
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
