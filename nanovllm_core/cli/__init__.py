"""The ``nanovllm`` command: ``generate``, ``serve``, ``plugins``, ``config``, one module each, and the commands
plugins add (``nanovllm_register_commands``; ``bench`` and ``simulate`` ship in ``nanovllm-bench``). Every engine
command takes ``--config FILE`` (TOML, or vLLM's YAML)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanovllm_core.cli import config, generate, plugins, serve
from nanovllm_core.cli.config import config_reference
from nanovllm_core.cli.engine_flags import cli_overrides
from nanovllm_core.cli.serve import cmd_serve
from nanovllm_core.config import YAML_SUFFIXES
from nanovllm_core.errors import ConfigError, NanoVLLMError, UnknownPluginError

__all__ = ["build_parser", "cli_overrides", "cmd_serve", "config_reference", "main", "parse_command_line"]

BUILT_IN = (generate, plugins, config, serve)
YAML_CONFIG = ("generate", "serve", "config")
"""The built-in commands that read vLLM's YAML ``--config``; a plugin command does when its ``yaml_config`` says so."""


def build_parser() -> argparse.ArgumentParser:
    return _build_parser()[0]


def _build_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The parser, and the commands that read vLLM's YAML ``--config``."""
    parser = argparse.ArgumentParser(prog="nanovllm", description="A small vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in BUILT_IN:
        module.add_parser(sub)
    yaml_config = set(YAML_CONFIG) | add_plugin_commands(sub)
    missing = missing_commands(sub)
    if missing:
        parser.epilog = "Not installed: " + "; ".join(
            f"{', '.join(names)} (pip install {dist})" for dist, names in sorted(missing.items())
        )
    return parser, yaml_config


def add_plugin_commands(sub: argparse._SubParsersAction) -> set[str]:
    """The commands installed plugins register, each under its name unless the command has that name already; the
    names of those added that read vLLM's YAML ``--config``."""
    from nanovllm_core.plugins import get_registry

    yaml_config = set()
    for name, registration in sorted(get_registry().registrations["command"].items()):
        if name in sub.choices:
            print(
                f"nanovllm: the {registration.distribution} plugin's command {name!r} is not added: nanovllm has a "
                "command of that name",
                file=sys.stderr,
            )
            continue
        command = registration.obj()
        parser = sub.add_parser(name, help=command.help, description=command.description or command.help)
        command.add_arguments(parser)
        parser.set_defaults(func=command.run)
        if command.yaml_config:
            yaml_config.add(name)
    return yaml_config


def missing_commands(sub: argparse._SubParsersAction) -> dict[str, list[str]]:
    """The project's plugin commands that are not installed, by the distribution that ships them."""
    from nanovllm_core.plugins import PROVIDERS

    missing: dict[str, list[str]] = {}
    for name, dist in PROVIDERS["command"].items():
        if name not in sub.choices:
            missing.setdefault(dist, []).append(name)
    return missing


def check_command_installed(command: str) -> None:
    """For ``nanovllm COMMAND`` where no installed plugin adds COMMAND: raise the one-line error that says which
    distribution ships it (one of the project's commands), or which plugins register it twice; else nothing (argparse
    then lists the commands there are)."""
    from nanovllm_core.plugins import PROVIDERS, get_registry, missing_hint

    registry = get_registry()
    if command in registry.conflicts["command"]:
        registry.get("command", command)  # raises PluginConflictError naming both plugins
    dist = PROVIDERS["command"].get(command)
    if dist is None:
        return
    message = f"`nanovllm {command}` is not installed. {missing_hint('command', command)}"
    broken = [b for b in registry.broken if b.distribution == dist]
    if broken:
        message += f" ({dist} is installed but did not load: {broken[0].error})"
    raise UnknownPluginError(message)


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def yaml_config_flags(path: str, parser: argparse.ArgumentParser, command: str) -> list[str]:
    """vLLM's YAML config (``--config config.yaml``, keys are long flag names: ``max-model-len: 4096``) as the
    flags of ``nanovllm COMMAND`` it stands for. ``model`` is ``--model``; ``true`` is the bare flag, ``false`` its
    ``--no-`` form (or nothing, for a flag without one); a list gives several values; ``null`` is left out."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"config file {path!r} is YAML, which needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as f:
            table = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory; give the path of a YAML or TOML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (offset {exc.start}): save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if table is None:
        return []
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path!r}: a YAML mapping of flag names to values, e.g. `max-model-len: 4096`")
    options = parser._option_string_actions
    flags: list[str] = []
    for key, value in table.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in options or flag == "--config":
            raise ConfigError(
                f"config file {path!r}: {key!r} is not a flag of nanovllm {command} (keys are long flag names, "
                f"as `nanovllm {command} --help` lists them)"
            )
        if value is None:
            continue
        if isinstance(value, bool):
            negative = "--no-" + flag[2:]
            if value:
                flags.append(flag)
            elif negative in options:
                flags.append(negative)
            continue
        values = value if isinstance(value, list) else [value]
        flags.append(flag)
        flags += [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in values]
    return flags


def _yaml_config_in(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(path, argv without it)`` when ``argv`` gives ``--config FILE.yaml`` (or ``.yml``)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            path, end = argv[i + 1], i + 2
        elif arg.startswith("--config="):
            path, end = arg.split("=", 1)[1], i + 1
        else:
            continue
        return (path, argv[:i] + argv[end:]) if Path(path).suffix.lower() in YAML_SUFFIXES else None
    return None


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; a ``--config FILE.yaml`` (vLLM's) gives the flags it stands for, under those of the command
    line: command line > config file > defaults, and a MODEL argument wins over the file's ``model``, as in vLLM."""
    parser, yaml_config = _build_parser()
    command_parser = _subcommand_parser(parser, argv[0]) if argv else None
    if command_parser is None and argv:
        check_command_installed(argv[0])
    found = _yaml_config_in(argv) if argv and argv[0] in yaml_config else None
    if command_parser is None or found is None:
        return parser.parse_args(argv)
    path, rest = found
    # the file's flags first, in a namespace of their own; parsing the command line into it then sets only what the
    # command line gives (argparse fills in a default only where the namespace has no value)
    args = command_parser.parse_args(yaml_config_flags(path, command_parser, argv[0]))
    args = command_parser.parse_args(rest[1:], namespace=args)
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command_line(argv)
    except NanoVLLMError as exc:  # a YAML config that cannot be read, a command that is not installed
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except NanoVLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

