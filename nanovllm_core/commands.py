"""The command plugin kind: a subcommand of ``nanovllm`` that a plugin adds (as simonw's ``llm`` lets plugins add
commands with ``register_commands``).

A plugin registers a :class:`Command` subclass with ``nanovllm_register_commands``; ``nanovllm NAME ...`` then
builds it as ``cls()``, lets it add its arguments to its own ``argparse`` parser and runs it with the parsed
arguments. A name the ``nanovllm`` command already has is not added (``nanovllm --help`` lists what is).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from typing import ClassVar


class Command(ABC):
    """One ``nanovllm`` subcommand. ``help``: its line in ``nanovllm --help``; ``description``: its
    ``nanovllm NAME --help`` text (default: ``help``)."""

    help: ClassVar[str] = ""
    description: ClassVar[str] = ""

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's arguments to its parser."""

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run the command; its exit status. A :class:`nanovllm_core.errors.NanoVLLMError` it raises is printed
        as ``error: ...`` with exit status 2, as the built-in commands' are."""
