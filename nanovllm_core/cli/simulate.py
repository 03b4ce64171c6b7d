"""``nanovllm simulate``: a scheduler policy judged on a workload in simulated time."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm simulate`` to the command's subparsers."""
    simulate = sub.add_parser(
        "simulate",
        help="judge a scheduler policy on a workload without a GPU (simulated time, calibrated step costs)",
        description="Replay a workload through the real engine core and the installed scheduler and block-manager "
        "plugins, each step's duration from a GPU calibration; reports bench serve's metrics. --calibrate fits a "
        "calibration from nanovllm bench --json results.",
    )
    _add_simulate_flags(simulate)
    simulate.set_defaults(func=cmd_simulate)


def _add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.simulate.run import add_simulate_arguments

    add_simulate_arguments(parser)


def cmd_simulate(args: argparse.Namespace) -> int:
    from nanovllm_core.simulate.run import run_simulate

    return run_simulate(args)

