"""What the first ``generate`` after start-up does that the next ones do not (the one-GPU issue's first-run gap).

    python benchmarks/cold_paths.py [--shape qwen3-0.6b] [--runs 2] [--json PATH]

Runs nano-vllm's workload as ``nanovllm bench`` does (random-weight checkpoint, ``attention = "triton"``, one
warm-up prompt, then ``--runs`` timed ``generate`` calls) and reports, per phase (start-up, warm-up, each run):
the Triton JIT compilations (kernel and seconds: a variant the start-up did not compile), the CUDA memory segments
the caching allocator had to add, the garbage collections, and the slowest steps with their position in the run.
Run it with ``TORCH_LOGS=recompiles`` to see torch.compile recompilations too (they go to stderr, with their cause).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from nanovllm_core.benchmark import SHAPES, random_checkpoint, workload


class Phases:
    """Attributes Triton compilations, allocator segments and GC pauses to the phase in progress."""

    def __init__(self) -> None:
        self.name = "start-up"
        self.report: dict[str, dict[str, Any]] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self._begin()

    def _begin(self) -> None:
        self.report[self.name] = {"compiles": [], "gc_s": 0.0, "gc_count": 0, "segments_before": _segments()}

    def _on_gc(self, stage: str, info: dict) -> None:
        if stage == "start":
            self._gc_start = time.perf_counter()
        else:
            entry = self.report[self.name]
            entry["gc_s"] += time.perf_counter() - self._gc_start
            entry["gc_count"] += 1

    def compiled(self, kernel: str, seconds: float) -> None:
        self.report[self.name]["compiles"].append({"kernel": kernel, "s": round(seconds, 3)})

    def start(self, name: str) -> None:
        self.end()
        self.name = name
        self._begin()

    def end(self) -> None:
        entry = self.report[self.name]
        entry["new_segments"] = _segments() - entry.pop("segments_before")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def _segments() -> int:
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


@contextlib.contextmanager
def watch_triton(phases: Phases) -> Iterator[bool]:
    """Log every Triton JIT compilation into ``phases`` while inside; yields False where this Triton has no hook."""
    from triton.runtime.jit import JITFunction

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        yield False
        return

    def logged(self, *args, **kwargs):
        start = time.perf_counter()
        kernel = original(self, *args, **kwargs)
        phases.compiled(getattr(self, "__name__", str(self)), time.perf_counter() - start)
        return kernel

    JITFunction._do_compile = logged
    try:
        yield True
    finally:
        JITFunction._do_compile = original


def timed_steps(llm: Any) -> list[float]:
    """Wrap ``llm.step`` to record each step's wall time (the list is refilled per run)."""
    durations: list[float] = []
    step = llm.step

    def timed():
        start = time.perf_counter()
        out = step()
        durations.append(time.perf_counter() - start)
        return out

    llm.step = timed
    return durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--attention", default="triton")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    phases = Phases()
    try:
        with watch_triton(phases) as hooked:
            run(args, phases)
    finally:
        phases.close()
    report = {"shape": args.shape, "triton_compiles_watched": hooked, "phases": phases.report}
    for name, entry in phases.report.items():
        compiles = entry["compiles"]
        print(f"{name}: {len(compiles)} Triton compiles ({sum(c['s'] for c in compiles):.2f} s), "
              f"{entry['new_segments']} new CUDA segments, {entry['gc_count']} GCs ({entry['gc_s']:.3f} s)"
              + (f", {entry['tok_per_s']:,} tok/s" if "tok_per_s" in entry else ""))  # fmt: skip
        if name != "start-up":
            for c in compiles:
                print(f"    compiled {c['kernel']} in {c['s']} s")
        if "slowest_steps" in entry:
            print("    slowest steps: " + ", ".join(f"#{s['step']} {s['ms']} ms" for s in entry["slowest_steps"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def run(args: argparse.Namespace, phases: Phases) -> None:
    """The start-up, the warm-up and the timed runs, each in its phase."""
    from nanovllm_core import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    prompts, max_tokens = workload(256, 1024, 1024) if cuda else workload(4, 100, 100)  # CPU: a check of the script
    llm = LLM(str(random_checkpoint(args.shape, dtype)), max_model_len=4096, plugins={"attention": args.attention})
    vocab = llm.hf_config.vocab_size
    phases.start("warm-up")
    warm = SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True)
    llm.generate([[(t + 1000) % vocab for t in prompts[0]]], warm, use_tqdm=False)
    durations = timed_steps(llm)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    for index in range(args.runs):
        phases.start(f"run {index + 1}")
        durations.clear()
        start = time.perf_counter()
        outputs = llm.generate([[(t + index) % vocab for t in p] for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        slowest = sorted(range(len(durations)), key=durations.__getitem__, reverse=True)[:8]
        phases.report[phases.name].update(
            seconds=round(elapsed, 3), tok_per_s=round(tokens / elapsed), steps=len(durations),
            slowest_steps=[{"step": i, "ms": round(1e3 * durations[i], 2)} for i in slowest],
        )  # fmt: skip
    phases.end()
    llm.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
