"""``nanovllm bench`` (the offline benchmark) and ``nanovllm bench serve`` (a running server's), and ``nanovllm
simulate`` (a scheduler policy judged on a workload in simulated time): their arguments and what they run."""

from __future__ import annotations

import argparse

from nanovllm_core import Command

# Every process that loads the plugins imports this module (for the classes it registers): what the commands need
# is imported when they are built or run.


class BenchCommand(Command):
    """``nanovllm bench [serve]``: the engine's flags (and vLLM's YAML ``--config``), and a ``serve`` mode."""

    help = "throughput benchmark (nano-vllm's workload)"
    yaml_config = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_bench_parser(parser)

    def run(self, args: argparse.Namespace) -> int:
        return cmd_bench_serve(args) if args.bench_mode == "serve" else cmd_bench(args)


class SimulateCommand(Command):
    help = "judge a scheduler policy on a workload without a GPU (simulated time, calibrated step costs)"
    description = (
        "Replay a workload through the real engine core and the installed scheduler and block-manager plugins, each "
        "step's duration from a GPU calibration; reports bench serve's metrics. --calibrate fits a calibration from "
        "nanovllm bench --json results."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_simulate_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        return cmd_simulate(args)


def add_bench_parser(bench: argparse.ArgumentParser) -> None:
    """``nanovllm bench``'s arguments and its ``serve`` mode (``args.bench_mode``), on its parser."""
    from nanovllm_core.cli.engine_flags import add_engine_flags
    from nanovllm_core.demo import DEMO_MAX_MODEL_LEN

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
    bench_modes = bench.add_subparsers(dest="bench_mode", metavar="serve", help="`bench serve`: load a running server")
    bench_serve = bench_modes.add_parser(
        "serve",
        help="load a running OpenAI-compatible server (nanovllm serve) and report its latencies",
        description="Serving benchmark (vLLM's benchmark_serving metrics) against a running server.",
    )
    from nanovllm_bench.serve import add_bench_serve_arguments

    add_bench_serve_arguments(bench_serve)


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_bench.offline import add_bench_arguments

    add_bench_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm_bench.offline import run_bench
    from nanovllm_core.cli.engine_flags import cli_overrides
    from nanovllm_core.demo import DEMO_MAX_MODEL_LEN, ensure_demo_checkpoint

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
    from nanovllm_bench.serve import run_bench_serve

    return run_bench_serve(args)


def _add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_bench.simulate.run import add_simulate_arguments

    add_simulate_arguments(parser)


def cmd_simulate(args: argparse.Namespace) -> int:
    from nanovllm_bench.simulate.run import run_simulate

    return run_simulate(args)
