"""Data-parallel routing policies on a workload of shared prompt prefixes (CPU, the tiny demo checkpoint).

    python benchmarks/routing.py                                   # cache_aware, round_robin, least_loaded
    python benchmarks/routing.py --policies cache_aware,round_robin --waves 12
    python benchmarks/routing.py --backend ray                     # the same through Ray replica actors

``--groups`` system prompts of ``--prefix-tokens`` tokens each; every wave sends one request per group (the
prefix, then ``--suffix-tokens`` tokens of its own), in a shuffled order, as one ``LLM.generate`` call to
``--data-parallel-size`` replicas. Each replica's KV cache (``--num-kvcache-blocks``) holds about half of the
prefixes, so where a request lands decides whether its prefix is still cached there. For each policy: the prefix-cache
hit rate over all replicas, and the time to first token (from each request's arrival at its replica) and the
wall time of the waves after the first. Results go to RESULTS_DIR/routing.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from _common import add_common_arguments, machine, out_dir, split_list, write_json

POLICIES = ["cache_aware", "round_robin", "least_loaded"]


def workload(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """The waves: each a shuffled list of one prompt per group (token ids)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.groups)]
    waves = []
    for _ in range(args.waves):
        prompts = [p + [rng.randrange(3, vocab) for _ in range(args.suffix_tokens)] for p in prefixes]
        rng.shuffle(prompts)
        waves.append(prompts)
    return waves


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.demo import ensure_demo_checkpoint

    llm = LLM(
        str(ensure_demo_checkpoint()), device="cpu", data_parallel_size=args.data_parallel_size,
        data_parallel_backend=args.backend, num_kvcache_blocks=args.num_kvcache_blocks,
        kvcache_block_size=args.block_size, max_model_len=args.prefix_tokens + args.suffix_tokens + args.max_tokens,
    )  # fmt: skip
    try:
        llm.engine_client.router.policy = policy
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        waves = workload(args, llm.hf_config.vocab_size)
        llm.generate(waves[0], params, use_tqdm=False)  # every prefix placed once: the later waves are measured
        before = llm.stats()
        ttft: list[float] = []
        start = time.perf_counter()
        for prompts in waves[1:]:
            for out in llm.generate(prompts, params, use_tqdm=False):
                ttft.append(out.metrics.time_to_first_token)
        seconds = time.perf_counter() - start
        after = llm.stats()
    finally:
        llm.shutdown()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    ttft.sort()
    return {
        "policy": policy,
        "prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
        "ttft_mean_ms": 1000 * statistics.fmean(ttft),
        "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
        "ttft_p90_ms": 1000 * ttft[int(0.9 * (len(ttft) - 1))],
        "seconds": seconds,
        "requests": len(ttft),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, dry_run=False)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ", ".join(POLICIES))
    parser.add_argument("--backend", choices=("mp", "ray"), default="mp", help="data_parallel_backend")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--waves", type=int, default=8, help="requests per group (the first wave is not measured)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-kvcache-blocks", type=int, default=96, help="per replica (default: about half of the prefixes)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    policies = split_list(args.policies, POLICIES, "--policies")
    rows = [run_policy(policy, args) for policy in policies]
    print(f"{'policy':<14}{'hit rate':>10}{'TTFT mean':>12}{'p50':>10}{'p90':>10}{'waves s':>10}")
    for row in rows:
        print(
            f"{row['policy']:<14}{row['prefix_cache_hit_rate']:>10.1%}{row['ttft_mean_ms']:>10.1f}ms"
            f"{row['ttft_p50_ms']:>8.1f}ms{row['ttft_p90_ms']:>8.1f}ms{row['seconds']:>10.2f}"
        )
    settings = {k: v for k, v in vars(args).items() if k != "results_dir"}
    write_json(out_dir(args.results_dir, "") / "routing.json", {**machine(), "settings": settings, "policies": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
