"""``nanovllm bench``: nano-vllm's throughput workload, and the bound it is measured against.

Workload (nano-vllm's ``bench.py``): 256 sequences, ``random.seed(0)``, prompts of ``randint(100, 1024)``
token ids ``randint(0, 10000)``, outputs of ``randint(100, 1024)`` tokens, ``ignore_eos=True``,
temperature 0.6. Weights may be random: the work is the same.

The bound: device-memory bytes that must move (weights once per step, every KV read by decode attention,
every KV written) over the measured copy bandwidth, plus the matmul FLOPs over the measured bf16 GEMM
rate. Both rates are measured by the benchmark itself on the device it runs on. Beside it, the per-step
bound: each decode step the longer of its bytes and its matmul FLOPs, plus the prompts' FLOPs (or their KV writes,
if longer): the sum overstates the minimum when a step is compute-bound, as the 8B's are.

On CUDA the last run's steps are timed on the GPU one by one, and the decode steps' times are fitted to a fixed
part, a part per sequence and a part per KV token read (``decode_step_fit``): where the distance to the bound
is. ``--profile`` then lists the kernels of 32 decode steps (``--profile-seqs``: at several batch sizes).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from nanovllm_core.config import EngineConfig, read_config_file
from nanovllm_core.errors import ConfigError
from nanovllm_core.gc_heap import GCPauses

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
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
QWEN3_14B = dict(
    vocab_size=151936,
    hidden_size=5120,
    intermediate_size=17408,
    num_layers=40,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=10240,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen3-14b": QWEN3_14B, "tiny": TINY}


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


def profile_sizes(text: str, num_seqs: int) -> list[int]:
    """``--profile-seqs`` as batch sizes: comma-separated integers from 1 to ``num_seqs``; empty: ``[num_seqs]``."""
    try:
        sizes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        sizes = [0]
    if any(not 1 <= n <= num_seqs for n in sizes):
        raise ConfigError(f"--profile-seqs {text!r}: comma-separated batch sizes from 1 to --num-seqs ({num_seqs})")
    return sizes or [num_seqs]


def random_checkpoint(shape: str, dtype: torch.dtype) -> Path:
    from nanovllm_core.testing import write_tiny_checkpoint

    path = Path("/tmp") / f"nanovllm-bench-{shape}-{str(dtype).split('.')[-1]}"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, "qwen3", dtype=dtype, init_std=0.02, **SHAPES[shape])
    return path


def measure_device(device: torch.device, sustained_gemm_s: float = 0.0) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM FLOP/s of ``device``.

    The GEMM rate is a short burst's (10 products, a few milliseconds). With ``sustained_gemm_s``, the same product
    also runs back to back for that many seconds, and the rate of the second half is ``gemm_flop_per_s_sustained``:
    what the GPU keeps up once its power limit holds its clock down (an H200 at 700 W, round 14)."""
    if device.type != "cuda":
        return {}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 2 * n * 20 / (start.elapsed_time(end) / 1e3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * m**3 * 10 / (start.elapsed_time(end) / 1e3)
    rates = {"copy_bytes_per_s": bandwidth, "gemm_flop_per_s": flops}
    if sustained_gemm_s > 0:
        rates["gemm_flop_per_s_sustained"] = sustained_gemm_rate(a, b, sustained_gemm_s)
    return rates


def sustained_gemm_rate(a: torch.Tensor, b: torch.Tensor, seconds: float, per_batch: int = 20) -> float:
    """FLOP/s of ``a @ b`` over the second half of ``seconds`` of back-to-back products (batches of ``per_batch``,
    each timed by device events; the first half lets the clock settle)."""
    batches: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            a @ b
        end.record()
        end.synchronize()  # keeps the host's clock in step with the device's
        batches.append((time.perf_counter() - began, start, end))
    late = [(s, e) for t, s, e in batches if t >= seconds / 2] or [(s, e) for _, s, e in batches[-1:]]
    device_ms = sum(s.elapsed_time(e) for s, e in late)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * per_batch * len(late) / (device_ms / 1e3)


def bound_seconds(
    hf_config: Any, prompts: list[list[int]], max_tokens: list[int], device: dict[str, float], dtype_bytes: int = 2
) -> dict[str, float]:
    """Lower bound of the workload's time from the model shape and the measured device rates."""
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    matmul_params = layers * per_layer + vocab * hidden  # the LM head is a matmul too
    weight_bytes = matmul_params * dtype_bytes
    kv_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(max_tokens)
    decode_steps = max(max_tokens) - 1
    kv_read = sum(kv_per_token * (len(p) * (m - 1) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
    kv_written = kv_per_token * (prompt_tokens + output_tokens)
    bytes_moved = kv_read + kv_written + weight_bytes * decode_steps
    flops = 2 * matmul_params * (prompt_tokens + output_tokens)
    # causal attention of the prompts (QK^T and PV)
    flops += sum(2 * 2 * layers * heads * head_dim * len(p) * len(p) / 2 for p in prompts)
    bandwidth, gemm_rate = device["copy_bytes_per_s"], device["gemm_flop_per_s"]
    memory_s = bytes_moved / bandwidth
    compute_s = flops / gemm_rate
    # The per-step form: each decode step takes the longer of its bytes and its matmul FLOPs (a step whose GEMMs
    # are compute-bound is not also memory-bound); the prompts' FLOPs, or their KV writes if longer, as one prefill
    prompt_flops = flops - 2 * matmul_params * output_tokens
    per_step_s = max(prompt_flops / gemm_rate, kv_per_token * prompt_tokens / bandwidth)
    by_length = sorted(zip(max_tokens, (len(p) for p in prompts)))
    active, context = len(by_length), prompt_tokens  # decoding sequences, their prompt tokens
    done = 0
    for step in range(1, decode_steps + 1):
        while done < len(by_length) and by_length[done][0] - 1 < step:  # produced all its tokens
            active -= 1
            context -= by_length[done][1]
            done += 1
        read = context + step * active  # each sequence reads its prompt and the tokens generated so far
        step_bytes = weight_bytes + kv_per_token * (read + active)
        step_flops = 2 * matmul_params * active
        per_step_s += max(step_bytes / bandwidth, step_flops / gemm_rate)
    return {
        "bound_s": memory_s + compute_s,
        "per_step_bound_s": per_step_s,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bytes_moved": bytes_moved,
        "flops": flops,
        "kv_bytes_per_token": kv_per_token,
    }


def fit_decode_steps(records: list[tuple[int, int, int, float]], kv_bytes_per_token: int) -> dict[str, Any]:
    """Where a run's decode steps spend their GPU time, from each step's (sequences, query tokens, KV tokens
    attended, GPU ms) as the model runner records them.

    A least-squares fit of ``ms = fixed + per_seq * sequences + per_kv_token * kv_tokens`` over the pure decode
    steps (one query token a sequence) splits their time into a part every step pays whatever its batch (weights
    read, launches, the per-kernel floors), a part that grows with the batch (GEMM rows, sampling) and a part that
    grows with the context read (decode attention: ``kv_bytes_per_token / per_kv_token`` is its KV read rate).
    Steps with prompt tokens are summed apart."""
    decode = [r for r in records if r[0] == r[1]]
    prefill_s = sum(r[3] for r in records if r[0] != r[1]) / 1e3
    result: dict[str, Any] = {"decode_steps": len(decode), "prompt_steps": len(records) - len(decode)}
    result["prompt_steps_gpu_s"] = prefill_s
    if len(decode) < 4:
        return result
    x = torch.tensor([[1.0, r[0], r[2]] for r in decode], dtype=torch.float64)
    y = torch.tensor([r[3] for r in decode], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    fitted = x @ coef
    residual = float(((y - fitted) ** 2).sum())
    spread = float(((y - y.mean()) ** 2).sum())
    fixed_ms, per_seq_ms, per_kv_ms = (float(c) for c in coef)
    seqs, kv = float(x[:, 1].sum()), float(x[:, 2].sum())
    result.update(
        decode_steps_gpu_s=float(y.sum()) / 1e3,
        fixed_ms_per_step=fixed_ms,
        per_seq_us=1e3 * per_seq_ms,
        per_kv_token_ns=1e6 * per_kv_ms,
        kv_read_bytes_per_s=kv_bytes_per_token / (per_kv_ms / 1e3) if per_kv_ms > 0 else None,
        fixed_s=fixed_ms * len(decode) / 1e3,
        per_seq_s=per_seq_ms * seqs / 1e3,
        per_kv_s=per_kv_ms * kv / 1e3,
        r2=1 - residual / spread if spread else None,
    )
    return result


def run_step_timing(summary: dict[str, float], records: list[tuple[int, int, int, float]]) -> dict[str, Any]:
    """One run's device time by kind of step, and its slowest decode steps: where a first run's extra time goes
    (compilation shows as a long prompt or decode step, a graph's first replay as a slow decode step)."""
    decode = [r for r in records if r[0] == r[1]]
    slowest = sorted(decode, key=lambda r: r[3], reverse=True)[:5]
    return {
        "gpu_busy_s": summary.get("gpu_busy_s", 0.0),
        "gpu_idle_s": summary.get("gpu_idle_s", 0.0),
        "host_prepare_s": summary.get("host_prepare_s", 0.0),
        "prompt_steps_s": sum(r[3] for r in records if r[0] != r[1]) / 1e3,
        "decode_steps_s": sum(r[3] for r in decode) / 1e3,
        "slowest_decode_steps": [{"seqs": r[0], "kv_tokens": r[2], "ms": r[3]} for r in slowest],
    }


def allocator_counts() -> dict[str, float]:
    """Running totals of the CUDA allocators' growth: pinned host blocks created (and the milliseconds spent
    creating them), device segments ``cudaMalloc``-ed, and the device allocator's retries (a retry frees the cache
    and synchronises). A run that grows either pool pays for it inside its steps."""
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    device = torch.cuda.memory_stats()
    return {
        "pinned_allocs": float(host.get("num_host_alloc", 0)),
        "pinned_alloc_ms": float(host.get("host_alloc_time.total", 0)) / 1e3,
        "device_segments": float(device.get("segment.all.allocated", 0)),
        "device_alloc_retries": float(device.get("num_alloc_retries", 0)),
    }


_triton_compiles = 0


def count_triton_compiles() -> bool:
    """Count, from now on in this process, every Triton kernel variant compiled or loaded from Triton's disk cache
    (a miss of a ``@triton.jit`` kernel's in-memory cache: Triton's ``jit_cache_hook``). False where this Triton
    has no such hook."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return False
    previous = knobs.runtime.jit_cache_hook
    if getattr(previous, "counts_triton_compiles", False):
        return True  # counting already (a second bench in this process)

    def hook(*args: Any, **kwargs: Any) -> Any:
        global _triton_compiles
        _triton_compiles += 1
        return previous(*args, **kwargs) if previous is not None else None  # (a true return skips the compile)

    hook.counts_triton_compiles = True  # type: ignore[attr-defined]
    knobs.runtime.jit_cache_hook = hook
    return True


def compile_counts() -> dict[str, float]:
    """Running totals of kernel compilation: Triton kernel variants (after :func:`count_triton_compiles`) and the
    frames ``torch.compile`` compiled. A run that compiles pays for it inside its steps."""
    counts = {"triton_kernels": float(_triton_compiles)}
    try:
        from torch._dynamo.utils import counters

        counts["compiled_frames"] = float(counters["frames"]["ok"])
    except ImportError:
        pass
    return counts


def format_run_timing(timing: dict[str, Any]) -> str:
    slowest = ", ".join(f"{s['ms']:.2f} ms ({s['seqs']} seqs)" for s in timing["slowest_decode_steps"])
    grown = timing.get("allocator_growth")
    growth = (
        f"; allocators grew by {grown['pinned_allocs']:.0f} pinned blocks ({grown['pinned_alloc_ms']:.1f} ms), "
        f"{grown['device_segments']:.0f} device segments, {grown['device_alloc_retries']:.0f} retries"
        if grown
        else ""
    )
    compiled = timing.get("compiles")
    if compiled:
        growth += f"; compiled {compiled['triton_kernels']:.0f} Triton kernels"
        if "compiled_frames" in compiled:
            growth += f" and {compiled['compiled_frames']:.0f} torch.compile frames"
    return (
        f"GPU busy {timing['gpu_busy_s']:.3f} s (prompt steps {timing['prompt_steps_s']:.3f}, decode steps "
        f"{timing['decode_steps_s']:.3f}), idle {timing['gpu_idle_s']:.3f} s, host input preparation "
        f"{timing['host_prepare_s']:.3f} s; slowest decode steps: {slowest}{growth}"
    )


def run_bench(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from nanovllm_core import LLM, SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() and overrides.get("device") != "cpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        overrides["model"] = args.model
    elif "model" not in overrides and not (args.config and "model" in read_config_file(args.config)):
        # a config file without a model (one that sets plugins or their options) gets the random weights too
        overrides["model"] = str(random_checkpoint(args.shape, dtype))
    overrides.setdefault("max_model_len", 4096)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    profile_seqs = profile_sizes(args.profile_seqs, len(prompts))  # before anything loads: bad input costs nothing

    data_parallel = EngineConfig.load(args.config, cli_overrides=overrides).data_parallel_size
    # With data parallelism the engines run in replica processes, one GPU group each: this process measures no
    # device (that would hold memory on the first GPU, which replica 0 then lacks) and reports no bound.
    rates = measure_device(device, args.sustained_gemm_s) if data_parallel == 1 else {}
    count_triton_compiles()
    t0 = time.perf_counter()
    llm = LLM(config=args.config, cli_overrides=overrides)
    load_s = time.perf_counter() - t0
    # warm-up: a full-size prefill and some decode steps, so compilation and autotuning stay out of the timing
    # (every token id shifted by one, so that no block of the timed prompts is in the prefix cache)
    vocab = llm.hf_config.vocab_size
    if args.warmup_prompts > 0:
        warm = [[(t + 1000) % vocab for t in p] for p in prompts[: args.warmup_prompts]]
        llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    run_tok_per_s = []
    run_gc: list[GCPauses] = []
    run_timing: list[dict[str, Any]] = []
    for run in range(max(1, args.runs)):
        run_prompts = prompts if run == 0 else [[(t + run) % vocab for t in p] for p in prompts]
        before = llm.stats()
        if data_parallel == 1:
            llm.step_stats.totals.update(prefill_tokens=0, decode_tokens=0, prefill_s=0.0, decode_s=0.0)
            llm.runner.track_gpu_time = device.type == "cuda"
            llm.runner.reset_step_tracking()
            if device.type == "cuda":
                torch.cuda.synchronize()
        # (not under data parallelism: this process holds no GPU, and querying the allocators would create a context)
        counts_before = allocator_counts() if data_parallel == 1 and device.type == "cuda" else None
        compiles_before = compile_counts()
        with GCPauses() as pauses:  # this process's garbage collections during the run (a full one can take
            started = time.time()  # (wall clock: to line up with samples of the GPU's clock)
            start = time.perf_counter()  # a noticeable part of a run: see nanovllm_core.gc_heap)
            outputs = llm.generate(run_prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        run_gc.append(pauses)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        run_tok_per_s.append(produced / elapsed)
        if data_parallel == 1 and device.type == "cuda":
            run_timing.append(run_step_timing(llm.runner.timing_summary(), llm.runner.step_records()))
            run_timing[-1].update(started=started, seconds=elapsed)
            if counts_before is not None:
                counts_after = allocator_counts()
                run_timing[-1]["allocator_growth"] = {k: counts_after[k] - counts_before[k] for k in counts_after}
            compiles_after = compile_counts()
            run_timing[-1]["compiles"] = {k: compiles_after[k] - compiles_before.get(k, 0.0) for k in compiles_after}
        if args.runs > 1:
            print(f"run {run + 1}: {produced} tok in {elapsed:.2f} s = {produced / elapsed:,.0f} tok/s; "
                  f"garbage collection: {pauses.summary()}")  # fmt: skip
            if run_timing:
                print(f"  {format_run_timing(run_timing[-1])}")
    after = llm.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    if data_parallel == 1:
        totals = llm.step_stats.totals
        engine: dict[str, Any] = {
            "attention": llm.attention_backend_name,
            "dtype": str(llm.dtype),
            "prefill_tok_per_s": totals["prefill_tokens"] / totals["prefill_s"] if totals["prefill_s"] else 0.0,
            "decode_tok_per_s": totals["decode_tokens"] / totals["decode_s"] if totals["decode_s"] else 0.0,
            "num_kvcache_blocks": llm.runner.num_kvcache_blocks,
            "cuda_graphs": llm.runner.graphs is not None,
            "async_scheduling": llm.async_scheduling,
        }
    else:  # what the replicas report: the settings and their stats (the rest lives in their processes)
        engine = {
            "attention": llm.config.plugins.attention,
            "dtype": llm.config.dtype,
            "num_kvcache_blocks": after.num_kv_blocks,
            "cuda_graphs": None,  # decided inside each replica
            "async_scheduling": llm.config.async_scheduling,  # the setting ("auto": each replica decides)
            "data_parallel_size": data_parallel,
            "replica_output_tokens": [s.num_generation_tokens for s in llm.replica_stats()],
        }
    result: dict[str, Any] = {
        "model": llm.config.model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        **engine,
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
    if data_parallel == 1:
        result.update(llm.runner.timing_summary())
        records = llm.runner.step_records()  # the last run's steps
        if records:
            kv_per_token = llm.runner.kv_block_bytes() // llm.runner.block_size  # this cache's bytes, fp8 or not
            result["decode_step_fit"] = fit_decode_steps(records, kv_per_token)
            result["step_records"] = records
    if rates:
        bound = bound_seconds(llm.hf_config, prompts, max_tokens, rates)
        result.update(rates)
        result.update(bound)
        result["bound_tok_per_s"] = produced / bound["bound_s"]
        result["percent_of_bound"] = 100 * bound["bound_s"] / elapsed
        result["per_step_bound_tok_per_s"] = produced / bound["per_step_bound_s"]
        result["percent_of_per_step_bound"] = 100 * bound["per_step_bound_s"] / elapsed
        if "gemm_flop_per_s_sustained" in rates:
            sustained = {**rates, "gemm_flop_per_s": rates["gemm_flop_per_s_sustained"]}
            sustained_s = bound_seconds(llm.hf_config, prompts, max_tokens, sustained)["per_step_bound_s"]
            result["per_step_bound_sustained_s"] = sustained_s
            result["per_step_bound_sustained_tok_per_s"] = produced / sustained_s
            result["percent_of_per_step_bound_sustained"] = 100 * sustained_s / elapsed
    print(
        f"attention={result['attention']} device={result['device']} blocks={result['num_kvcache_blocks']} "
        f"cuda_graphs={result['cuda_graphs']} async_scheduling={result['async_scheduling']} "
        f"preemptions={result['num_preemptions']} prefix_cache_hit_rate={100 * result['prefix_cache_hit_rate']:.1f}%"
    )
    if data_parallel == 1:
        split = f"prefill {result['prefill_tok_per_s']:,.0f} tok/s, decode {result['decode_tok_per_s']:,.0f} tok/s"
    else:
        split = f"{data_parallel} data-parallel replicas, output tokens {result['replica_output_tokens']} since start"
    print(f"Total: {produced} tok, Time: {elapsed:.2f}s, Throughput: {produced / elapsed:,.0f} tok/s ({split})")
    if rates:
        print(
            f"Device: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 GEMM {rates['gemm_flop_per_s'] / 1e12:.0f} "
            f"TFLOP/s; bound {result['bound_s']:.2f} s = {result['bound_tok_per_s']:,.0f} tok/s "
            f"(memory {result['memory_s']:.2f} s + compute {result['compute_s']:.2f} s); "
            f"achieved {result['percent_of_bound']:.1f}% of the bound; per-step bound (each decode step the longer "
            f"of its bytes and FLOPs) {result['per_step_bound_s']:.2f} s = {result['per_step_bound_tok_per_s']:,.0f} "
            f"tok/s, achieved {result['percent_of_per_step_bound']:.1f}%"
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
            f"{fit['per_kv_token_ns']:.3f} ns a KV token" + (f" ({kv_rate / 1e12:.2f} TB/s of KV)" if kv_rate else "")
            + f", r2 {fit['r2']:.4f}: fixed {fit['fixed_s']:.2f} s, per sequence {fit['per_seq_s']:.2f} s, per KV "
            f"token {fit['per_kv_s']:.2f} s; steps with prompt tokens ({fit['prompt_steps']}) "
            f"{fit['prompt_steps_gpu_s']:.2f} s"
        )
    if args.profile and device.type == "cuda":
        if data_parallel == 1:
            for n in profile_seqs:
                profile_decode(llm, prompts[:n])
            profile_prompts(llm, [[(t + 7) % vocab for t in p] for p in prompts[: max(profile_seqs)]])
        else:
            print("--profile profiles one engine in this process: run it without --data-parallel-size")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def profile_decode(llm: Any, prompts: list[list[int]], steps: int = 32) -> None:
    """Profile ``steps`` decode steps of the full batch; print where the GPU time goes, kernel by kernel, and how
    much of each step's GPU time (CUDA events around the steps) no kernel or copy covers."""
    from torch.profiler import ProfilerActivity, profile

    from nanovllm_core import SamplingParams

    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10**6)
    before_tokens = llm.stats().num_generation_tokens
    ids = [llm.add_request(p, params) for p in prompts]
    while llm.stats().num_generation_tokens < before_tokens + len(prompts):
        llm.step()  # finish the prefills first: every request has its first token
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            llm.step()
        end.record()
        torch.cuda.synchronize()
    for request_id in ids:
        llm.abort_request(request_id)
    print_kernels(prof, f"profile of {steps} decode steps with {len(prompts)} sequences", steps, start, end)


def profile_prompts(llm: Any, prompts: list[list[int]]) -> None:
    """Profile the steps that run ``prompts`` (fresh token ids: no prefix-cache hits) until each has its first
    token, and print their kernels as :func:`profile_decode` does."""
    from torch.profiler import ProfilerActivity, profile

    from nanovllm_core import SamplingParams

    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2)
    before_tokens, steps = llm.stats().num_generation_tokens, 0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        ids = [llm.add_request(p, params) for p in prompts]
        while llm.stats().num_generation_tokens < before_tokens + len(prompts):
            llm.step()
            steps += 1
        end.record()
        torch.cuda.synchronize()
    for request_id in ids:
        llm.abort_request(request_id)
    tokens = sum(len(p) for p in prompts)
    label = f"profile of the {steps} steps that run {len(prompts)} prompts ({tokens} tokens)"
    print_kernels(prof, label, steps, start, end)


def print_kernels(prof: Any, label: str, steps: int, start: Any, end: Any) -> None:
    """The profile's GPU time a step, its kernel count, the time between kernels, and its top 15 kernels."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    span_ms = start.elapsed_time(end) / steps
    kernels_ms = total / 1e3 / steps
    print(
        f"{label}: GPU kernel time {kernels_ms:.2f} ms/step in {sum(e.count for e in events) / steps:.0f} kernels "
        f"and copies a step; {span_ms:.2f} ms/step from first to last, so {span_ms - kernels_ms:.2f} ms/step "
        f"between them"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(
            f"  {100 * e.self_device_time_total / total:5.1f}%  {e.self_device_time_total / 1e3 / steps:7.3f} ms/step"
            f"  x{e.count / steps:<5.1f} {e.key[:90]}"
        )
