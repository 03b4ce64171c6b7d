"""``nanovllm serve``: an OpenAI-compatible server."""

from __future__ import annotations

import argparse

from nanovllm_core.cli.engine_flags import add_engine_flags, cli_overrides


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm serve`` to the command's subparsers."""
    serve = sub.add_parser(
        "serve",
        help="serve MODEL over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics. Stops on SIGTERM/SIGINT: in-flight requests get --shutdown-timeout seconds, then exit 0.",
    )
    from nanovllm_core.serving.serve import add_serve_arguments

    add_serve_arguments(serve)
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from nanovllm_core.serving.serve import run_serve

    return run_serve(args, cli_overrides(args))

