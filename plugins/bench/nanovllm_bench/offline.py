"""``nanovllm bench``: nano-vllm's throughput workload, measured against the bound of the configuration it runs.

Workload (nano-vllm's ``bench.py``): 256 sequences, ``random.seed(0)``, prompts of ``randint(100, 1024)``
token ids ``randint(0, 10000)``, outputs of ``randint(100, 1024)`` tokens, ``ignore_eos=True``,
temperature 0.6. Weights may be random: the work is the same.

Before the workload it measures the device's copy bandwidth and GEMM rate (``device``) and afterwards reports the
throughput against the bound of this configuration: KV cache dtype, weight dtype, tensor-parallel size
(``bound``). On CUDA the last run's steps are timed on the GPU one by one and the decode steps' times fitted to a
fixed part, a part per sequence and a part per KV token read: where the distance to the bound is. ``--profile``
then lists the kernels of 32 decode steps (``--profile-seqs``: at several batch sizes).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from tqdm.auto import tqdm

from nanovllm_bench.bound import ModelCost, bound_seconds, fit_decode_steps, model_cost
from nanovllm_bench.device import measure_device
from nanovllm_bench.probes import (
    allocator_counts,
    compile_counts,
    count_triton_compiles,
    format_run_timing,
    profile_decode,
    profile_prompts,
    profile_sizes,
    run_step_timing,
)
from nanovllm_core.config import read_config_file
from nanovllm_core.errors import ConfigError
from nanovllm_core.gc_heap import GCPauses
from nanovllm_core.layers.triton_jit import launch_options

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
# the 8B: wider and deeper, the same heads' shape, its own output embedding
QWEN3_8B = {**QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_layers": 36, "num_heads": 32,
            "tie_word_embeddings": False}  # fmt: skip
TINY = dict(vocab_size=10240, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "tiny": TINY}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-0.6b",
        help="random-weight model shape used when --model is not given",
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument(
        "--warmup-prompts",
        type=int,
        default=32,
        help="prompts of the throw-away generate before timing (8 tokens each; 1 is nano-vllm's own warm-up, "
        "0 times the very first generate)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="time the workload this many times (runs after the first shift every token id by the run's index, so "
        "that no prompt is found in the prefix cache); the last run is reported, every run is listed",
    )
    parser.add_argument(
        "--sustained-gemm-s",
        type=float,
        default=0.0,
        help="also run the GEMM rate's product back to back for this many seconds, and report the per-step bound at "
        "the rate of the second half (a GPU held at its power limit sustains less than the short burst's rate)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, profile 32 decode steps and print the top GPU kernels, then the same for the steps that "
        "run the prompts",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are shown on a terminal only: checkpoint writing, start-up, warm-up, each run)",
    )
    parser.add_argument(
        "--profile-seqs",
        default="",
        help="with --profile: comma-separated batch sizes to profile (the first N prompts each); default: all",
    )


def workload(num_seqs: int, max_input_len: int, max_output_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's lengths: prompts of randint(100, max_input_len), outputs of randint(100, max_output_len)."""
    for name, value in (("--max-input-len", max_input_len), ("--max-output-len", max_output_len)):
        if value < 100:
            raise ConfigError(f"{name} {value} is too small: the workload draws lengths from 100 up to it (>= 100)")
    if num_seqs < 1:
        raise ConfigError(f"--num-seqs {num_seqs}: at least 1")
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def random_checkpoint(shape: str, dtype: torch.dtype, progress: bool | None = False) -> Path:
    """The random-weight checkpoint of ``shape`` in ``dtype``, written under /tmp on first use (``progress``: with a
    progress bar as :class:`Phase` shows it)."""
    from nanovllm_core.demo import write_once, write_tiny_checkpoint

    path = Path("/tmp") / f"nanovllm-bench-{shape}-{str(dtype).split('.')[-1]}"
    if not (path / "config.json").is_file():  # benches started at once: one writes it, the others wait for it
        with Phase(f"writing the random-weight {shape} checkpoint to {path}", enabled=progress):
            write_once(path, lambda to: write_tiny_checkpoint(to, "qwen3", dtype=dtype, init_std=0.02, **SHAPES[shape]))
    return path


class Phase:
    """A progress bar for one long phase of the benchmark: its elapsed time and, given ``done`` (read from a thread
    every ``interval`` seconds, so that the engine's steps do no work for it), how much of ``total`` is done.

    ``enabled`` None: shown on a terminal only (a log would get one line per refresh); False: not shown."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        done: Callable[[], float] | None = None,
        enabled: bool | None = None,
        file: IO[str] | None = None,
        interval: float = 0.5,
        unit: str = "tok",
    ) -> None:
        self.total, self.done, self.interval = total, done, interval
        counted = total is not None and done is not None
        self.bar = tqdm(
            total=total if counted else None,
            desc=desc,
            unit=unit,
            file=file,
            disable=None if enabled is None else not enabled,
            dynamic_ncols=True,
            bar_format=None if counted else "{desc}: {elapsed}",
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="bench-progress", daemon=True)

    def _refresh(self) -> None:
        while not self._stop.wait(self.interval):
            if self.done is not None and self.total is not None:
                self.bar.n = min(self.total, int(self.done()))
            self.bar.refresh()

    def __enter__(self) -> Phase:
        if not self.bar.disable:
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if exc_type is None and self.total is not None and self.done is not None:
            self.bar.n = self.total
        self.bar.close()


def _tokens_done(llm: Any) -> Callable[[], float] | None:
    """The engine's prompt and output tokens so far (its step counters; None where the engines run elsewhere)."""
    totals = getattr(getattr(llm, "step_stats", None), "totals", None)
    if totals is None:
        return None
    start = totals["prefill_tokens"] + totals["decode_tokens"]
    return lambda: totals["prefill_tokens"] + totals["decode_tokens"] - start


def run_bench(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.engine.config_resolver import create_engine_config

    device = torch.device("cuda" if torch.cuda.is_available() and overrides.get("device") != "cpu" else "cpu")
    progress = False if getattr(args, "no_progress", False) else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        overrides["model"] = args.model
    elif "model" not in overrides and not (args.config and "model" in read_config_file(args.config)):
        # a config file without a model (one that sets plugins or their options) gets the random weights too
        overrides["model"] = str(random_checkpoint(args.shape, dtype, progress=progress))
    overrides.setdefault("max_model_len", 4096)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    profile_seqs = profile_sizes(args.profile_seqs, len(prompts))  # before anything loads: bad input costs nothing

    config = create_engine_config(config=args.config, cli_overrides=overrides)  # finished once: LLM takes it as is
    device = torch.device(config.device)  # the finished config's: a --config file may have named it
    data_parallel = config.data_parallel_size
    # With data parallelism the engines run in replica processes, one GPU group each: this process measures no
    # device (that would hold memory on the first GPU, which replica 0 then lacks) and reports no bound.
    in_process = data_parallel == 1
    on_gpu = in_process and device.type == "cuda"
    rates = {}
    if in_process:
        with Phase(f"measuring the {device.type} device's copy and GEMM rates", enabled=progress):
            rates = measure_device(device, args.sustained_gemm_s)
    count_triton_compiles()
    t0 = time.perf_counter()
    with Phase("starting the engine (loading, KV cache, warm-up steps)", enabled=progress):
        llm = LLM(config=config)
    load_s = time.perf_counter() - t0
    # warm-up: a full-size prefill and some decode steps, so compilation and autotuning stay out of the timing
    # (every token id shifted, so that no block of the timed prompts is in the prefix cache)
    vocab = llm.hf_config.vocab_size
    if args.warmup_prompts > 0:
        warm = [[(t + 1000) % vocab for t in p] for p in prompts[: args.warmup_prompts]]
        total = sum(len(p) + 8 for p in warm)
        desc = f"warm-up: {len(warm)} prompt{'s' if len(warm) > 1 else ''}"
        with Phase(desc, total, _tokens_done(llm), enabled=progress):
            llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    run_tok_per_s: list[float] = []
    run_gc: list[GCPauses] = []
    run_timing: list[dict[str, Any]] = []
    for run in range(max(1, args.runs)):
        run_prompts = [[(t + run) % vocab for t in p] for p in prompts]  # within the vocabulary, fresh each run
        before = llm.stats()
        if in_process:
            llm.step_stats.totals.update(prefill_tokens=0, decode_tokens=0, prefill_s=0.0, decode_s=0.0)
            llm.runner.track_gpu_time = device.type == "cuda"
            llm.runner.reset_step_tracking()
            if device.type == "cuda":
                torch.cuda.synchronize()
        # (not under data parallelism: this process holds no GPU, and querying the allocators would create a context)
        counts_before = allocator_counts() if on_gpu else None
        compiles_before = compile_counts()
        # this process's garbage collections during the run: a full one can take a noticeable part of it
        run_total = sum(len(p) for p in prompts) + sum(max_tokens)
        run_desc = f"run {run + 1} of {max(1, args.runs)}: {len(prompts)} sequences"
        with Phase(run_desc, run_total, _tokens_done(llm), enabled=progress), GCPauses() as pauses:
            start = time.perf_counter()
            outputs = llm.generate(run_prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        run_gc.append(pauses)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        run_tok_per_s.append(produced / elapsed)
        if on_gpu:
            timing = run_step_timing(llm.runner.timing_summary(), llm.runner.step_records())
            timing["seconds"] = elapsed
            if counts_before is not None:
                counts_after = allocator_counts()
                timing["allocator_growth"] = {k: counts_after[k] - counts_before[k] for k in counts_after}
            compiles_after = compile_counts()
            timing["compiles"] = {k: compiles_after[k] - compiles_before.get(k, 0.0) for k in compiles_after}
            run_timing.append(timing)
        if args.runs > 1:
            print(f"run {run + 1}: {produced} tok in {elapsed:.2f} s = {produced / elapsed:,.0f} tok/s; "
                  f"garbage collection: {pauses.summary()}")  # fmt: skip
            if run_timing:
                print(f"  {format_run_timing(run_timing[-1])}")
    after = llm.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    result: dict[str, Any] = {
        "model": llm.config.model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        **_engine_report(llm, after, in_process, data_parallel),
        "num_seqs": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": produced,
        "seconds": elapsed,
        "output_tok_per_s": produced / elapsed,
        "load_s": load_s,
        "enforce_eager": llm.config.enforce_eager,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
        "warmup_prompts": args.warmup_prompts,
        "runs_tok_per_s": run_tok_per_s,
        "runs_gc_seconds": [sum(p.seconds) for p in run_gc],
        "runs_gc_full_collections": [p.collections[2] for p in run_gc],
        "runs_timing": run_timing,
    }
    kv_per_token = None
    if in_process:
        result.update(llm.runner.timing_summary())
        kv_per_token = llm.runner.kv_block_bytes() // llm.runner.block_size  # this cache's bytes, fp8 or not
        records = llm.runner.step_records()  # the last run's steps
        if records:
            result["decode_step_fit"] = fit_decode_steps(records, kv_per_token)
            result["step_records"] = records
    if rates:
        cost = model_cost(
            llm.hf_config,
            llm.dtype,
            llm.config.kv_cache_dtype,
            llm.config.tensor_parallel_size,
            kv_bytes_per_token_per_layer=kv_per_token // llm.hf_config.num_hidden_layers if kv_per_token else None,
            quantization=llm.config.quantization,
            quantized_weight_bits=quantized_weight_bits(llm.config.quantization),
        )
        result.update(_bound_report(cost, prompts, max_tokens, rates, produced, elapsed))
    _print_report(result, rates, args, data_parallel)
    if args.profile and device.type == "cuda":
        if in_process:
            for n in profile_seqs:
                profile_decode(llm, prompts[:n])
            profile_prompts(llm, [[(t + 7) % vocab for t in p] for p in prompts[: max(profile_seqs)]])
        else:
            print("--profile profiles one engine in this process: run it without --data-parallel-size")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def quantized_weight_bits(quantization: str | None) -> int | None:
    """Bits per weight of the quantization method ``quantization`` (its ``weight_bits``), None without one."""
    if quantization is None:
        return None
    from nanovllm_core.plugins import get_registry

    return get_registry().get("quantization", quantization).obj.weight_bits


def _engine_report(llm: Any, stats: Any, in_process: bool, data_parallel: int) -> dict[str, Any]:
    if in_process:
        totals = llm.step_stats.totals
        return {
            "attention": llm.attention_backend_name,
            "dtype": str(llm.dtype),
            "kv_cache_dtype": llm.config.kv_cache_dtype,
            "quantization": llm.config.quantization,
            "tensor_parallel_size": llm.config.tensor_parallel_size,
            "prefill_tok_per_s": totals["prefill_tokens"] / totals["prefill_s"] if totals["prefill_s"] else 0.0,
            "decode_tok_per_s": totals["decode_tokens"] / totals["decode_s"] if totals["decode_s"] else 0.0,
            "num_kvcache_blocks": llm.runner.num_kvcache_blocks,
            "cuda_graphs": llm.runner.graphs is not None,
            "cuda_graph_max_mixed_tokens": llm.config.cuda_graph_max_mixed_tokens,
            "async_scheduling": llm.async_scheduling,
            # whether the kernels launched with it: the setting, on a GPU that has it
            "programmatic_dependent_launch": launch_options(torch.empty(0, device=llm.runner.device))["PDL"],
        }
    return {  # what the replicas report: the settings and their stats (the rest lives in their processes)
        "attention": llm.config.plugins.attention,
        "dtype": llm.config.dtype,
        "kv_cache_dtype": llm.config.kv_cache_dtype,
        "tensor_parallel_size": llm.config.tensor_parallel_size,
        "num_kvcache_blocks": stats.num_kv_blocks,
        "cuda_graphs": None,  # decided inside each replica
        "cuda_graph_max_mixed_tokens": llm.config.cuda_graph_max_mixed_tokens,
        "async_scheduling": llm.config.async_scheduling,  # the setting ("auto": each replica decides)
        "programmatic_dependent_launch": llm.config.programmatic_dependent_launch,  # the setting, as above
        "data_parallel_size": data_parallel,
        "replica_output_tokens": [s.num_generation_tokens for s in llm.replica_stats()],
    }


def _bound_report(
    cost: ModelCost,
    prompts: list[list[int]],
    max_tokens: list[int],
    rates: dict[str, float],
    produced: int,
    elapsed: float,
) -> dict[str, Any]:
    bound = bound_seconds(cost, prompts, max_tokens, rates)
    report: dict[str, Any] = {**rates, **bound, "bound_config": cost.describe()}
    report.update(
        bound_tok_per_s=produced / bound["bound_s"],
        percent_of_bound=100 * bound["bound_s"] / elapsed,
        per_step_bound_tok_per_s=produced / bound["per_step_bound_s"],
        percent_of_per_step_bound=100 * bound["per_step_bound_s"] / elapsed,
    )
    if "gemm_flop_per_s_sustained" in rates:
        sustained = {**rates, "gemm_flop_per_s": rates["gemm_flop_per_s_sustained"]}
        sustained_s = bound_seconds(cost, prompts, max_tokens, sustained)["per_step_bound_s"]
        report.update(
            per_step_bound_sustained_s=sustained_s,
            per_step_bound_sustained_tok_per_s=produced / sustained_s,
            percent_of_per_step_bound_sustained=100 * sustained_s / elapsed,
        )
    return report


def _print_report(result: dict[str, Any], rates: dict[str, float], args: argparse.Namespace, dp: int) -> None:
    print(
        f"attention={result['attention']} device={result['device']} blocks={result['num_kvcache_blocks']} "
        f"cuda_graphs={result['cuda_graphs']} async_scheduling={result['async_scheduling']} "
        f"programmatic_dependent_launch={result['programmatic_dependent_launch']} "
        f"preemptions={result['num_preemptions']} prefix_cache_hit_rate={100 * result['prefix_cache_hit_rate']:.1f}%"
    )
    produced, elapsed = result["output_tokens"], result["seconds"]
    if dp == 1:
        split = f"prefill {result['prefill_tok_per_s']:,.0f} tok/s, decode {result['decode_tok_per_s']:,.0f} tok/s"
    else:
        split = f"{dp} data-parallel replicas, output tokens {result['replica_output_tokens']} since start"
    print(f"Total: {produced} tok, Time: {elapsed:.2f}s, Throughput: {produced / elapsed:,.0f} tok/s ({split})")
    if rates:
        print(
            f"Device: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 GEMM {rates['gemm_flop_per_s'] / 1e12:.0f} TFLOP/s\n"
            f"Bound: per-step, {result['bound_config']}: each decode step the longer of its bytes and its FLOPs, "
            f"{result['per_step_bound_s']:.2f} s = {result['per_step_bound_tok_per_s']:,.0f} tok/s, achieved "
            f"{result['percent_of_per_step_bound']:.1f}%; additive bound {result['bound_s']:.2f} s = "
            f"{result['bound_tok_per_s']:,.0f} tok/s (memory {result['memory_s']:.2f} s + compute "
            f"{result['compute_s']:.2f} s), achieved {result['percent_of_bound']:.1f}%"
        )
    if "per_step_bound_sustained_s" in result:
        print(
            f"Sustained bf16 GEMM {rates['gemm_flop_per_s_sustained'] / 1e12:.0f} TFLOP/s "
            f"({args.sustained_gemm_s:g} s back to back, second half); per-step bound at that rate "
            f"{result['per_step_bound_sustained_s']:.2f} s = {result['per_step_bound_sustained_tok_per_s']:,.0f} "
            f"tok/s, achieved {result['percent_of_per_step_bound_sustained']:.1f}%"
        )
    if "gpu_idle_s" in result:
        print(
            f"GPU busy {result['gpu_busy_s']:.2f} s, idle between steps {result['gpu_idle_s']:.2f} s "
            f"({100 * result['gpu_idle_fraction']:.1f}%), host input preparation "
            f"{result['host_prepare_ms_per_step']:.3f} ms/step over {result['steps']} steps"
        )
    fit = result.get("decode_step_fit", {})
    if "fixed_ms_per_step" in fit:
        kv_rate = fit["kv_read_bytes_per_s"]
        print(
            f"Decode steps ({fit['decode_steps']}, {fit['decode_steps_gpu_s']:.2f} s of GPU): "
            f"{fit['fixed_ms_per_step']:.3f} ms each + {fit['per_seq_us']:.2f} us a sequence + "
            f"{fit['per_kv_token_ns']:.3f} ns a KV token"
            + (f" ({kv_rate / 1e12:.2f} TB/s of KV)" if kv_rate else "")
            + f", r2 {fit['r2']:.4f}: fixed {fit['fixed_s']:.2f} s, per sequence {fit['per_seq_s']:.2f} s, per KV "
            f"token {fit['per_kv_s']:.2f} s; steps with prompt tokens ({fit['prompt_steps']}) "
            f"{fit['prompt_steps_gpu_s']:.2f} s"
        )
