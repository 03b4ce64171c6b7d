"""Per-step host work for 256 running sequences in decode: schedule + postprocess + input preparation.

    python benchmarks/host_overhead.py [--num-seqs 256] [--steps 200] [--block-size 256]
                                       [--scheduler fifo|mixed|priority] [--stream ids|text] [--results-dir results]

Runs the real engine core (step validation, postprocess, stop checks, outputs) with a scheduler policy (`fifo`;
`mixed` and `priority` when their plugins are installed, with `--max-num-batched-tokens` steps), the
`prefix_cache` block manager, the sampler's per-step parameter gathering and the model runner's input preparation
(tensors on the CPU; on a GPU they would be copied from pinned memory without a sync). No model runs: this is
the time the host adds per step. CPU only. The medians go to RESULTS_DIR/host_overhead_SCHEDULER.json, beside
the machine's speed at the time (shared machines change speed: compare runs taken back to back).
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core import EngineConfig, SamplingParams
from nanovllm_core.engine.core import EngineCore
from nanovllm_core.engine.input_batch import InputBatch
from nanovllm_core.engine.model_runner import prepare_inputs
from nanovllm_core.engine_client.step_loop import pack_outputs


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
        self.input_batch = InputBatch(151936, torch.device("cpu"))
        self.seconds = 0.0

    def launch(self, batch, in_flight=None):
        t0 = time.perf_counter()
        inputs = prepare_inputs(batch, self.block_size, torch.device("cpu"))
        self.input_batch.sampling_batch([batch.seqs[r] for r in inputs.sample_rows])
        sampled = [self.tokens[i % len(self.tokens)] if batch.samples(i) else None for i in range(len(batch))]
        self.seconds += time.perf_counter() - t0
        return SimpleNamespace(batch=batch, tokens=lambda: sampled)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Host work per decode step (CPU, no model).")
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
    parser.add_argument("--results-dir", default="results", help="where the JSON goes (default results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        from nanovllm_testing import build_tokenizer

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
    reference = reference_ms()
    print(f"  (machine speed now: a fixed pure-Python reference loop takes {reference:.1f} ms)")
    result = {"args": vars(args), "reference_loop_ms": reference, "ms_per_step": {}}
    for key, values in timings.items():
        median, p90 = statistics.median(values), sorted(values)[int(0.9 * len(values))]
        result["ms_per_step"][key] = {"median": median, "p90": p90}
        print(f"  {key:20s} {median:.3f}  (p90 {p90:.3f})")
    out = Path(args.results_dir) / f"host_overhead_{args.scheduler}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
