"""Offline throughput of named workloads on one GPU, through ``nanovllm bench``, and one request alone.

    python benchmarks/offline.py                                   # every workload, in turn
    python benchmarks/offline.py --workloads 0.6b-bf16,0.6b-fp8 --runs 3
    python benchmarks/offline.py --dry-run                         # the commands, nothing run

Workloads (random weights of the named shape, written once to /tmp by ``nanovllm bench``; the ``triton``
attention backend):

- ``0.6b-bf16``, ``0.6b-fp8``, ``8b-bf16``, ``8b-fp8``: nano-vllm's benchmark (256 sequences, prompts and outputs
  of 100-1,024 tokens) on the Qwen3-0.6B or Qwen3-8B shape, with the model's bf16 KV cache or the fp8 one.
  ``8b-fp8-weights`` is ``8b-fp8`` with FP8 weights (``--quantization fp8``: the bf16 checkpoint quantized as it
  loads; nanovllm-quant-fp8). ``nanovllm bench`` runs it ``--runs`` times in one process; every run after the
  first shifts the token ids, so nothing comes from the prefix cache. Reported: the first run (what a fresh
  process gives), the later runs, the bound ``nanovllm bench`` prints and the share of it reached.
- ``single-0.6b``: one request alone on the 0.6B shape, a 512-token prompt and 512 output tokens: milliseconds
  per output token (the whole request's time over its tokens), the decode part alone, and the time to read the
  weights once at the measured copy rate (a decode step cannot take less), and the engine's start-up: its seconds,
  the CUDA graphs' share of them and the KV-cache blocks it made. ``nanovllm bench`` draws its lengths at random,
  so this one drives ``LLM`` directly (``--single``, in a process of its own). ``single-8b`` and
  ``single-8b-fp8-weights``: the same on the 8B shape, with bf16 or FP8 weights.

Each workload runs in a process of its own. Results go to RESULTS_DIR/offline/: NAME.json (what ``nanovllm
bench --json`` writes, or the single request's figures), NAME.log, and summary.json with the GPU, date and
commit; the script ends with one table row per workload in docs/performance.md's format.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    add_common_arguments,
    add_selection_argument,
    check_cli,
    copy_bytes_per_s,
    machine,
    markdown_row,
    nanovllm,
    out_dir,
    random_checkpoint,
    read_json,
    run,
    shown,
    split_list,
    write_json,
)

WORKLOADS: dict[str, list[str]] = {  # `nanovllm bench` flags of each workload; None: the single request
    "0.6b-bf16": ["--shape", "qwen3-0.6b", "--attention", "triton"],
    "0.6b-fp8": ["--shape", "qwen3-0.6b", "--attention", "triton", "--kv-cache-dtype", "fp8"],
    "8b-bf16": ["--shape", "qwen3-8b", "--attention", "triton"],
    "8b-fp8": ["--shape", "qwen3-8b", "--attention", "triton", "--kv-cache-dtype", "fp8"],
    "8b-fp8-weights": ["--shape", "qwen3-8b", "--attention", "triton", "--kv-cache-dtype", "fp8",
                       "--quantization", "fp8"],
    "single-0.6b": [],
    "single-8b": [],
    "single-8b-fp8-weights": [],
}
SINGLE = {  # --single's flags of each single-request workload
    "single-0.6b": ["--shape", "qwen3-0.6b"],
    "single-8b": ["--shape", "qwen3-8b"],
    "single-8b-fp8-weights": ["--shape", "qwen3-8b", "--quantization", "fp8"],
}


def command(name: str, args: argparse.Namespace, json_path: Path) -> list[str]:
    if name in SINGLE:
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "--single",
            *SINGLE[name],
            "--runs",
            str(args.runs),
            "--json",
            str(json_path),
        ]
    return nanovllm(
        "bench",
        *WORKLOADS[name],
        "--runs",
        str(args.runs),
        "--warmup-prompts",
        "1",
        "--json",
        str(json_path),
        *shlex.split(args.bench_args),
    )


def user_command(name: str, args: argparse.Namespace) -> str:
    """The command a row of docs/performance.md quotes: this script, for this workload alone."""
    cmd = ["python", "benchmarks/offline.py", "--workloads", name]
    if args.runs != 3:
        cmd += ["--runs", str(args.runs)]
    if args.bench_args and name not in SINGLE:
        cmd += ["--bench-args", args.bench_args]
    return shlex.join(cmd)


def summarize(name: str, result: dict[str, Any], args: argparse.Namespace, where: dict[str, str]) -> dict[str, Any]:
    """The figures a row of docs/performance.md holds."""
    row: dict[str, Any] = {"workload": name, "command": user_command(name, args), **where}
    row["gpu"] = result.get("device", where["gpu"])
    if name in SINGLE:
        row.update(
            {k: result[k] for k in ("ms_per_output_token", "decode_ms_per_token", "ttft_ms", "weights_read_bound_ms")}
        )
        return row
    runs = result.get("runs_tok_per_s") or [result["output_tok_per_s"]]
    row.update(first_run_tok_per_s=runs[0], later_runs_tok_per_s=runs[1:])
    bound = result.get("per_step_bound_tok_per_s")
    if bound:
        row.update(bound_tok_per_s=bound, first_run_percent_of_bound=100 * runs[0] / bound)
    return row


def table_row(row: dict[str, Any]) -> str:
    tail = [f"`{row['command']}`", row["gpu"], row["date"], row["commit"]]
    if "ms_per_output_token" in row:
        return markdown_row(
            [
                row["workload"],
                f"{row['ms_per_output_token']:.2f}",
                f"{row['weights_read_bound_ms']:.2f}" if row["weights_read_bound_ms"] else "",
                "",  # nano-vllm's figure, measured apart
                *tail,
            ]
        )
    later = row["later_runs_tok_per_s"]
    later_text = f"{min(later):,.0f}-{max(later):,.0f}" if later else ""
    bound = row.get("bound_tok_per_s")
    return markdown_row(
        [
            row["workload"],
            f"{row['first_run_tok_per_s']:,.0f}",
            later_text,
            f"{bound:,.0f}" if bound else "",
            f"{row['first_run_percent_of_bound']:.1f}%" if bound else "",
            "",  # nano-vllm's figure, measured apart
            *tail,
        ]
    )


def single_request(args: argparse.Namespace) -> dict[str, Any]:
    """One request alone: ``--prompt-len`` random token ids, ``--output-len`` tokens (no early stop), timed
    ``--runs`` times after a warm-up request; the best run is reported, every run listed."""
    import torch

    from nanovllm_core import LLM, SamplingParams

    checkpoint = random_checkpoint(args.shape)
    started = time.perf_counter()
    llm = LLM(
        str(checkpoint),
        plugins={"attention": args.attention},
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        programmatic_dependent_launch=args.programmatic_dependent_launch,
    )
    load_s = time.perf_counter() - started
    rng = random.Random(0)
    top_id = min(10000, llm.hf_config.vocab_size - 1)  # nano-vllm's ids, 0 to 10,000 (a tiny test model has fewer)
    prompt = [rng.randint(0, top_id) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([[(t + 1000) % top_id for t in prompt]], params, use_tqdm=False)  # warm-up, no prefix-cache hit
    runs = []
    for i in range(max(1, args.runs)):
        start = time.perf_counter()
        out = llm.generate([[(t + i) % top_id for t in prompt]], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        n, m = len(out.outputs[0].token_ids), out.metrics
        decode_s = (m.last_token_time - m.first_token_time) / (n - 1) if m and n > 1 else float("nan")
        runs.append(
            {
                "seconds": elapsed,
                "output_tokens": n,
                "ms_per_output_token": 1e3 * elapsed / n,
                "decode_ms_per_token": 1e3 * decode_s,
                "ttft_ms": 1e3 * (m.time_to_first_token or 0.0),
            }
        )
    best = min(runs, key=lambda r: r["ms_per_output_token"])
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    copy_rate = copy_bytes_per_s() if torch.cuda.is_available() else None  # the bound is a GPU's
    return {
        "shape": args.shape,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "attention": args.attention,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        **best,
        "runs": runs,
        "weight_bytes": weight_bytes,
        "copy_bytes_per_s": copy_rate,
        "weights_read_bound_ms": 1e3 * weight_bytes / copy_rate if copy_rate else None,
        # what the engine's start-up took and made (its log says the same): the CUDA graphs' share, the KV cache
        "load_s": load_s,
        "graph_capture_s": llm.runner.graph_capture_s if llm.runner.graphs is not None else None,
        "num_kvcache_blocks": llm.runner.num_kvcache_blocks,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Offline throughput of named workloads (nano-vllm's benchmark through `nanovllm bench`, and "
        "one request alone); results in RESULTS_DIR/offline/."
    )
    add_selection_argument(parser, "--workloads", WORKLOADS)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per workload (default 3)")
    parser.add_argument(
        "--bench-args",
        default="",
        metavar="FLAGS",
        help='more `nanovllm bench` flags for every bench workload, one quoted string, e.g. "--config my.toml"',
    )
    add_common_arguments(parser)
    single = parser.add_argument_group("the single request (--single runs it in this process)")
    single.add_argument("--single", action="store_true", help="run one request alone and write --json")
    single.add_argument("--shape", default="qwen3-0.6b", help="random-weight shape (default qwen3-0.6b)")
    single.add_argument("--prompt-len", type=int, default=512)
    single.add_argument("--output-len", type=int, default=512)
    single.add_argument("--max-model-len", type=int, default=4096, help="the engine's (default 4096)")
    single.add_argument("--attention", default="triton")
    single.add_argument("--kv-cache-dtype", default="auto")
    single.add_argument("--quantization", help="a quantization method, e.g. fp8 (nanovllm-quant-fp8)")
    single.add_argument(
        "--programmatic-dependent-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine setting of that name (default: on, as the engine's)",
    )
    single.add_argument("--json", type=Path, help="with --single: write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"error: --runs {args.runs}: at least 1")
    if args.single:
        if args.prompt_len < 1 or args.output_len < 2:
            raise SystemExit("error: --prompt-len at least 1 and --output-len at least 2")
        if args.dry_run:
            print(
                f"one request alone, {args.shape}: {args.prompt_len}-token prompt, {args.output_len} output tokens, "
                f"{args.runs} runs, attention {args.attention}, KV cache {args.kv_cache_dtype}, "
                f"programmatic dependent launch {'on' if args.programmatic_dependent_launch else 'off'}"
            )
            return 0
        result = single_request(args)
        bound = result["weights_read_bound_ms"]
        print(
            f"one request, {args.prompt_len}-token prompt, {result['output_tokens']} output tokens: "
            f"{result['ms_per_output_token']:.3f} ms per output token (decode {result['decode_ms_per_token']:.3f}"
            f" ms, first token {result['ttft_ms']:.1f} ms)"
            + (f"; reading the weights once takes {bound:.3f} ms" if bound else "")
        )
        graphs = result["graph_capture_s"]
        print(
            f"start-up {result['load_s']:.1f} s" + (f" ({graphs:.1f} s capturing CUDA graphs)" if graphs else "")
            + f", {result['num_kvcache_blocks']:,} KV-cache blocks"
        )
        if args.json:
            write_json(args.json, result)
        return 0
    names = split_list(args.workloads, WORKLOADS, "--workloads")
    folder = out_dir(args.results_dir, "offline", make=not args.dry_run)
    commands = {name: command(name, args, folder / f"{name}.json") for name in names}
    for name, cmd in commands.items():
        if name not in SINGLE:
            check_cli(cmd)
        if args.dry_run:
            print(shown(cmd))
    if args.dry_run:
        return 0
    where, rows, failed = machine(), [], []
    for name, cmd in commands.items():
        if run(cmd, folder / f"{name}.log") != 0:
            failed.append(name)
            continue
        rows.append(summarize(name, read_json(folder / f"{name}.json"), args, where))
    write_json(folder / "summary.json", rows)
    print("\nRows for docs/performance.md's offline tables:")
    for row in rows:
        print(table_row(row))
    if failed:
        print(f"failed: {', '.join(failed)} (see their logs in {folder})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
