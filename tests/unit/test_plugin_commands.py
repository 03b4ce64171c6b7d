"""The command plugin kind: a plugin's ``nanovllm_register_commands`` adds a subcommand to ``nanovllm``, which
parses its own arguments and runs; a name the command already has is not added; a class that is not a
``nanovllm_core.Command`` is a broken plugin, not a command; one of the project's commands that is not installed
(``bench``, ``simulate``) is a one-line error naming its distribution."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest

from nanovllm_core import PLUGIN_API_VERSION, Command, hookimpl, register_plugin, unregister_plugin
from nanovllm_core.cli import main, parse_command_line
from nanovllm_core.errors import ConfigError
from nanovllm_core.plugins import BrokenPlugin, PluginRegistry, get_registry, new_plugin_manager


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
    assert out.returncode == 0 and "generate" in out.stdout


def test_a_command_of_ours_that_is_not_installed_names_its_distribution(monkeypatch, capsys) -> None:
    registry = PluginRegistry(plugin_manager=new_plugin_manager())  # nothing installed: no nanovllm-bench
    monkeypatch.setattr("nanovllm_core.plugins.get_registry", lambda: registry)
    for argv in (["bench"], ["bench", "serve", "--help"], ["simulate", "--num-prompts", "3"], ["bench", "--help"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            f"error: `nanovllm {argv[0]}` is not installed. It ships in nanovllm-bench: pip install nanovllm-bench\n"
        )
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Not installed: bench, simulate (pip install nanovllm-bench)" in help_text
    assert "{generate,plugins,config,serve}" in help_text
    registry.broken.append(BrokenPlugin("bench", "nanovllm-bench", "0.1.0", "ImportError: no module named aiohttp"))
    assert main(["bench"]) == 2
    assert capsys.readouterr().err == (
        "error: `nanovllm bench` is not installed. It ships in nanovllm-bench: pip install nanovllm-bench "
        "(nanovllm-bench is installed but did not load: ImportError: no module named aiohttp)\n"
    )


def test_a_command_two_plugins_register_is_a_one_line_error(plugin_commands, capsys) -> None:
    plugin_commands("hello_plugin", {"hello": Hello})
    plugin_commands("hello_again_plugin", {"hello": Hello})
    assert main(["hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: two plugins register a command named 'hello': hello_plugin from (registered ")
    assert err.count("\n") == 1


def test_a_plugin_command_may_read_vllms_yaml_config(plugin_commands, tmp_path) -> None:
    """``yaml_config = True``: ``--config FILE.yaml`` stands for the flags it names, under the command line's; without
    it the command gets the path as it is."""
    pytest.importorskip("yaml")

    class Plain(Hello):
        def add_arguments(self, parser: argparse.ArgumentParser) -> None:
            super().add_arguments(parser)
            parser.add_argument("--config")

    class Engine(Plain):
        yaml_config = True

    plugin_commands("yaml_plugin", {"engine-hello": Engine, "plain-hello": Plain})
    path = tmp_path / "config.yaml"
    path.write_text("name: from-yaml\n")
    args = parse_command_line(["engine-hello", "--config", str(path)])
    assert (args.name, args.command) == ("from-yaml", "engine-hello")
    assert parse_command_line(["engine-hello", "--config", str(path), "--name", "flag"]).name == "flag"
    args = parse_command_line(["plain-hello", "--config", str(path)])
    assert (args.name, args.config) == ("world", str(path))
