"""The command plugin kind: a plugin's ``nanovllm_register_commands`` adds a subcommand to ``nanovllm``, which
parses its own arguments and runs; a name the command already has is not added; a class that is not a
``nanovllm_core.Command`` is a broken plugin, not a command."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest

from nanovllm_core import PLUGIN_API_VERSION, Command, hookimpl, register_plugin, unregister_plugin
from nanovllm_core.cli import main
from nanovllm_core.errors import ConfigError
from nanovllm_core.plugins import get_registry


class Hello(Command):
    help = "say hello"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--name", default="world")
        parser.add_argument("--fail", action="store_true")

    def run(self, args: argparse.Namespace) -> int:
        if args.fail:
            raise ConfigError("--fail: asked to fail")
        print(f"hello, {args.name}")
        return 0


class Serve(Hello):
    help = "a second serve"


def command_plugin(name: str, registrations: dict[str, object]) -> types.ModuleType:
    plugin = types.ModuleType(name)
    plugin.NANOVLLM_PLUGIN_API = PLUGIN_API_VERSION

    def nanovllm_register_commands(register):
        for command, cls in registrations.items():
            register(command, cls)

    plugin.nanovllm_register_commands = hookimpl(nanovllm_register_commands)
    return plugin


@pytest.fixture
def plugin_commands():
    names = []

    def install(name: str, registrations: dict[str, object]) -> None:
        register_plugin(command_plugin(name, registrations))
        names.append(name)

    yield install
    for name in names:
        unregister_plugin(name)


def test_a_plugin_command_parses_its_arguments_and_runs(plugin_commands, capsys) -> None:
    plugin_commands("hello_plugin", {"hello": Hello})
    assert main(["hello", "--name", "nanovllm"]) == 0
    assert capsys.readouterr().out == "hello, nanovllm\n"
    assert main(["hello", "--fail"]) == 2
    assert capsys.readouterr().err == "error: --fail: asked to fail\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "say hello" in capsys.readouterr().out


def test_a_plugin_command_named_like_a_built_in_one_is_not_added(plugin_commands, capsys) -> None:
    plugin_commands("serve_plugin", {"serve": Serve})
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    captured = capsys.readouterr()
    assert "OpenAI-compatible server" in captured.out  # the built-in one
    assert "command 'serve' is not added: nanovllm has a command of that name" in captured.err


def test_a_class_that_is_not_a_command_makes_the_plugin_broken(plugin_commands) -> None:
    plugin_commands("not_a_command_plugin", {"oops": object, "hello": Hello})
    registry = get_registry()
    assert "oops" not in registry.registrations["command"] and "hello" in registry.registrations["command"]
    errors = [b.error for b in registry.broken if b.plugin == "not_a_command_plugin"]
    assert any("is not a subclass of nanovllm_core.Command" in e for e in errors), errors


def test_python_dash_m_runs_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "nanovllm_core.cli", "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and "simulate" in out.stdout
