"""What ``nanovllm bench`` reports beside the throughput: each run's device time by kind of step, the
allocators' growth and the kernels compiled during a run (a first run slower than the next says where), and a
kernel profile of the decode and prompt steps (``--profile``)."""

from __future__ import annotations

from typing import Any

import torch

from nanovllm_core.errors import ConfigError


def profile_sizes(text: str, num_seqs: int) -> list[int]:
    """``--profile-seqs`` as batch sizes: comma-separated integers from 1 to ``num_seqs``; empty: ``[num_seqs]``."""
    try:
        sizes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        sizes = [0]
    if any(not 1 <= n <= num_seqs for n in sizes):
        raise ConfigError(f"--profile-seqs {text!r}: comma-separated batch sizes from 1 to --num-seqs ({num_seqs})")
    return sizes or [num_seqs]


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
    """One line of :func:`run_step_timing`'s result, with the allocators' growth and the compilations if known."""
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
    """The profile's GPU time a step, its kernel count, the time between kernels (or by how much they overlap),
    and its top 15 kernels."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    span_ms = start.elapsed_time(end) / steps
    kernels_ms = total / 1e3 / steps
    gap_ms = span_ms - kernels_ms
    if gap_ms >= 0:
        between = f"so {gap_ms:.2f} ms/step between them"
    else:  # the listed times hold more than the span: some kernels ran while others did
        between = (
            f"so the kernels overlap by {-gap_ms:.2f} ms/step: a kernel launched before the one it follows has "
            "finished (programmatic dependent launch) counts its wait in its time; "
            "--no-programmatic-dependent-launch lists each kernel's own"
        )
    print(
        f"{label}: GPU kernel time {kernels_ms:.2f} ms/step in {sum(e.count for e in events) / steps:.0f} kernels "
        f"and copies a step; {span_ms:.2f} ms/step from first to last, {between}"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(
            f"  {100 * e.self_device_time_total / total:5.1f}%  {e.self_device_time_total / 1e3 / steps:7.3f} ms/step"
            f"  x{e.count / steps:<5.1f} {e.key[:90]}"
        )
