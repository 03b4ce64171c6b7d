"""Per-step host work for 256 running sequences in decode: schedule + postprocess + input preparation.

    python benchmarks/host_overhead.py [--num-seqs 256] [--steps 200] [--block-size 256]
                                       [--scheduler fifo|mixed|priority] [--stream ids|text]

Runs the real engine core (step validation, postprocess, stop checks, outputs) with a scheduler policy (`fifo`;
`mixed` and `priority` when their plugins are installed, with `--max-num-batched-tokens` steps), the
`prefix_cache` block manager, the sampler's per-step parameter gathering and the model runner's input preparation
(tensors on the CPU; on a GPU they would be copied from pinned memory without a sync). No model runs: this is
the time the host adds per step.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from types import SimpleNamespace

import torch
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core import EngineConfig, SamplingParams
from nanovllm_core.engine.core import EngineCore
from nanovllm_core.engine.model_runner import prepare_inputs
from nanovllm_core.layers.sampler import SamplingBatch
from nanovllm_core.serving.step_loop import pack_outputs


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


class StubRunner:
    """The model runner's host work (input tensors, sampling parameters); tokens come from a fixed list."""

    def __init__(self, block_size: int, num_seqs: int) -> None:
        self.block_size = block_size
        self.tokens = [random.Random(1).randint(1, 10000) for _ in range(num_seqs)]
        self.seconds = 0.0

    def launch(self, batch, in_flight=None):
        t0 = time.perf_counter()
        inputs = prepare_inputs(batch, self.block_size, torch.device("cpu"))
        SamplingBatch.from_seqs([batch.seqs[r] for r in inputs.sample_rows], 151936, torch.device("cpu"))
        sampled = [self.tokens[i % len(self.tokens)] if batch.samples(i) else None for i in range(len(batch))]
        self.seconds += time.perf_counter() - t0
        return SimpleNamespace(batch=batch, tokens=lambda: sampled)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--scheduler", choices=["fifo", "mixed", "priority"], default="fifo")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument(
        "--stream",
        choices=["ids", "text"],
        help="every request streams (output_kind='delta'): token ids only, as the server's engine sends them "
        "(the front-end decodes), or with the text decoded in the engine (the tiny test tokenizer)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        model="unused",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        kvcache_block_size=args.block_size,
    )
    bm = PrefixCachingBlockManager(args.num_seqs * 16, args.block_size)
    runner = StubRunner(args.block_size, args.num_seqs)
    tokenizer, vocab, kind = None, 10000, "final"
    if args.stream:
        from nanovllm_core.testing import build_tokenizer

        tokenizer, kind = build_tokenizer(), "delta"
        vocab = tokenizer.vocab_size - 1
        runner.tokens = [t % vocab + 1 for t in runner.tokens]
    scheduler_cls = FifoScheduler
    if args.scheduler == "mixed":
        from nanovllm_scheduler_mixed import MixedScheduler as scheduler_cls
    elif args.scheduler == "priority":
        from nanovllm_scheduler_priority import PriorityScheduler as scheduler_cls
    core = EngineCore(
        config, scheduler_cls(config, bm), runner, scheduler_name=args.scheduler, tokenizer=tokenizer,
        eos_token_ids={0},
    )
    rng = random.Random(0)
    for _ in range(args.num_seqs):
        prompt = [rng.randint(1, vocab) for _ in range(rng.randint(100, 1024))]
        params = SamplingParams(
            temperature=0.6, ignore_eos=True, max_tokens=2048, output_kind=kind, detokenize=args.stream != "ids",
            priority=rng.randint(0, 1) if args.scheduler == "priority" else 0,
        )
        core.add_request(prompt, params)
    while core.scheduler.num_waiting:  # prefill everything
        core.step()
    timings = {"engine + scheduler": [], "runner host work": [], "total": []}
    if args.stream:  # what an engine process adds: the step's outputs packed and pickled for the pipe
        timings["emit (pack + pickle)"] = []
    for _ in range(args.steps):
        runner.seconds = 0.0
        t0 = time.perf_counter()
        outputs = core.step()
        total = time.perf_counter() - t0
        assert core.scheduler.num_running == args.num_seqs
        for key, value in zip(timings, (total - runner.seconds, runner.seconds, total)):
            timings[key].append(value * 1e3)
        if args.stream:
            t0 = time.perf_counter()
            pickle.dumps(("out", [], pack_outputs(outputs), 0.0, None), protocol=pickle.HIGHEST_PROTOCOL)
            timings["emit (pack + pickle)"].append((time.perf_counter() - t0) * 1e3)
    print(
        f"host work per decode step ({args.scheduler}), {args.num_seqs} running sequences, block size "
        f"{args.block_size}, "
        f"median of {args.steps} steps (ms):"
    )
    print(f"  (machine speed now: a fixed pure-Python reference loop takes {reference_ms():.1f} ms)")
    for key, values in timings.items():
        print(f"  {key:20s} {statistics.median(values):.3f}  (p90 {sorted(values)[int(0.9 * len(values))]:.3f})")


if __name__ == "__main__":
    main()
