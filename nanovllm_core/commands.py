"""The command plugin kind: a subcommand of ``nanovllm`` that a plugin adds (as simonw's ``llm`` lets plugins add
commands with ``register_commands``).

A plugin registers a :class:`Command` subclass with ``nanovllm_register_commands``; ``nanovllm NAME ...`` then
builds it as ``cls()``, lets it add its arguments to its own ``argparse`` parser and runs it with the parsed
arguments. A name the ``nanovllm`` command already has is not added (``nanovllm --help`` lists what is).

A command may add subcommands of its own to its parser (``add_subparsers``; ``nanovllm-bench``'s ``bench serve``)
and tell them apart in ``run`` by their ``dest``. One that takes the engine's flags
(:func:`nanovllm_core.cli.engine_flags.add_engine_flags`, ``--config`` among them) sets ``yaml_config`` to read
vLLM's YAML configs as ``generate`` and ``serve`` do.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from typing import ClassVar


class Command(ABC):
    """One ``nanovllm`` subcommand. ``help``: its line in ``nanovllm --help``; ``description``: its
    ``nanovllm NAME --help`` text (default: ``help``); ``yaml_config``: whether ``--config FILE.yaml`` (vLLM's YAML,
    long flag names as keys) stands for the flags it names, under those of the command line (default: no; the
    parser must then have a ``--config`` flag)."""

    help: ClassVar[str] = ""
    description: ClassVar[str] = ""
    yaml_config: ClassVar[bool] = False

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's arguments to its parser."""

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run the command; its exit status. A :class:`nanovllm_core.errors.NanoVLLMError` it raises is printed
        as ``error: ...`` with exit status 2, as the built-in commands' are."""
