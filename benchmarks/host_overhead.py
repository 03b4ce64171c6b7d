"""Per-step host work for 256 running sequences in decode: schedule + postprocess + input preparation.

    python benchmarks/host_overhead.py [--num-seqs 256] [--steps 200] [--block-size 256]

Uses the real `fifo` scheduler, `prefix_cache` block manager, the engine's stop check, the sampler's
per-step parameter gathering and the model runner's input preparation (tensors on the CPU; on a GPU they
would be copied from pinned memory without a sync). No model runs: this is the time the host adds per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core import EngineConfig, LLMEngine, SamplingParams, Sequence
from nanovllm_core.engine.model_runner import prepare_inputs
from nanovllm_core.layers.sampler import SamplingBatch


def reference_ms() -> float:
    """A fixed pure-Python workload: shared VMs change speed over minutes, this tells how fast this one is now."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        table = {}
        for i in range(200_000):
            table[i & 1023] = table.get(i & 1023, 0) + i
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        model="unused",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        kvcache_block_size=args.block_size,
    )
    engine_like = SimpleNamespace(eos_token_ids={0}, config=config, tokenizer=None)
    engine_like._token_stop = lambda seq: LLMEngine._token_stop(engine_like, seq)
    stop = lambda seq: LLMEngine.check_stop(engine_like, seq)  # noqa: E731 - the engine's own stop check
    bm = PrefixCachingBlockManager(args.num_seqs * 16, args.block_size)
    sched = FifoScheduler(config, bm, stop)
    rng = random.Random(0)
    for _ in range(args.num_seqs):
        prompt = [rng.randint(1, 10000) for _ in range(rng.randint(100, 1024))]
        sched.add(Sequence(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10**6)))
    device = torch.device("cpu")
    while sched.waiting:  # prefill everything
        batch = sched.schedule()
        sched.postprocess(batch, [rng.randint(1, 10000) if batch.samples(i) else None for i in range(len(batch))])
    sampled_tokens = [rng.randint(1, 10000) for _ in range(args.num_seqs)]
    timings = {"schedule": [], "prepare": [], "sampling_params": [], "postprocess": [], "total": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        inputs = prepare_inputs(batch, args.block_size, device)
        t2 = time.perf_counter()
        SamplingBatch.from_seqs([batch.seqs[r] for r in inputs.sample_rows], 151936, device)
        sampled = sampled_tokens[: len(batch.seqs)]  # what `logits.argmax(-1).tolist()` would return
        t3 = time.perf_counter()
        sched.postprocess(batch, sampled)
        t4 = time.perf_counter()
        assert len(batch.seqs) == args.num_seqs and batch.total_new_tokens == args.num_seqs
        for key, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            timings[key].append(value * 1e3)
    print(
        f"host work per decode step, {args.num_seqs} running sequences, block size {args.block_size}, "
        f"median of {args.steps} steps (ms):"
    )
    print(f"  (machine speed now: a fixed pure-Python reference loop takes {reference_ms():.1f} ms)")
    for key, values in timings.items():
        print(f"  {key:16s} {statistics.median(values):.3f}  (p90 {sorted(values)[int(0.9 * len(values))]:.3f})")


if __name__ == "__main__":
    main()
