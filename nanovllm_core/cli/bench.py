"""``nanovllm bench`` (the offline benchmark) and ``nanovllm bench serve`` (a running server's)."""

from __future__ import annotations

import argparse

from nanovllm_core.cli.engine_flags import add_engine_flags, cli_overrides
from nanovllm_core.demo import DEMO_MAX_MODEL_LEN, ensure_demo_checkpoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm bench`` to the command's subparsers."""
    bench = sub.add_parser("bench", help="throughput benchmark (nano-vllm's workload)")
    bench_which = bench.add_mutually_exclusive_group()
    bench_which.add_argument("--model", help="checkpoint folder; default: random weights of --shape")
    bench_which.add_argument(
        "--demo",
        action="store_true",
        help=f"the embedded tiny demo checkpoint (max_model_len {DEMO_MAX_MODEL_LEN} unless set; prompts and outputs "
        "of up to 200 tokens unless --max-input-len / --max-output-len say otherwise)",
    )
    _add_bench_flags(bench)
    add_engine_flags(bench)
    bench.set_defaults(func=cmd_bench)
    bench_modes = bench.add_subparsers(dest="bench_mode", metavar="serve", help="`bench serve`: load a running server")
    bench_serve = bench_modes.add_parser(
        "serve",
        help="load a running OpenAI-compatible server (nanovllm serve) and report its latencies",
        description="Serving benchmark (vLLM's benchmark_serving metrics) against a running server.",
    )
    from nanovllm_core.serving.bench import add_bench_serve_arguments

    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.bench.offline import add_bench_arguments

    add_bench_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm_core.bench.offline import run_bench

    overrides = cli_overrides(args)
    if args.demo:
        args.model = str(ensure_demo_checkpoint())
        overrides.setdefault("max_model_len", DEMO_MAX_MODEL_LEN)
        # nano-vllm's lengths (up to 1,024 + 1,024) do not fit the demo's context
        for flag in ("max_input_len", "max_output_len"):
            if getattr(args, flag) == DEMO_BENCH_DEFAULTS[flag]:
                setattr(args, flag, DEMO_BENCH_LEN)
    return run_bench(args, overrides)


DEMO_BENCH_DEFAULTS = {"max_input_len": 1024, "max_output_len": 1024}  # add_bench_arguments' defaults
DEMO_BENCH_LEN = 200



def cmd_bench_serve(args: argparse.Namespace) -> int:
    from nanovllm_core.serving.bench import run_bench_serve

    return run_bench_serve(args)

