"""``nanovllm config``: the resolved configuration and where each value came from, and the config reference."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from nanovllm_core.cli.engine_flags import add_engine_flags, add_model_flags, engine_flag_names, model_overrides
from nanovllm_core.config import EngineConfig, PluginsConfig
from nanovllm_core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm config`` to the command's subparsers."""
    config = sub.add_parser(
        "config",
        help="show the resolved config and where each value came from",
        description="Print the resolved engine configuration and where each value came from. When the model folder "
        "holds a checkpoint, the configuration is finished as `generate` and `serve` finish it, on this host, with "
        "every check they make before loading weights (max_model_len, device, dtype, quantization and attention "
        "backend decided); else the checks that need no checkpoint. Exits 2 on an invalid configuration.",
    )
    add_model_flags(config)
    config.add_argument("--reference", action="store_true", help="print the config reference (docs/config.md)")
    add_engine_flags(config)
    config.set_defaults(func=cmd_config)


# --- nanovllm config ----------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (strings, numbers, booleans, lists and inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{k if _BARE_KEY.match(k) else json.dumps(k)} = {toml_value(v)}" for k, v in value.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"{type(value).__name__} has no TOML form")


def render_config(config: EngineConfig) -> str:
    """The resolved config as TOML, each value commented with where it came from."""
    lines: list[tuple[str, str]] = []

    def add(key: str, value: Any, source_key: str) -> None:
        text = f"# {key} is unset" if value is None else f"{key} = {toml_value(value)}"
        lines.append((text, config.source_of(source_key)))

    for name in EngineConfig.model_fields:
        if name != "plugins":
            add(name, getattr(config, name), name)
    lines.append(("", ""))
    lines.append(("[plugins]", ""))
    for name in PluginsConfig.model_fields:
        add(name, getattr(config.plugins, name), f"plugins.{name}")
    width = max(len(text) for text, _ in lines)
    header = "# the resolved engine configuration; precedence: command line > keyword argument > file > default"
    return "\n".join([header] + [f"{t.ljust(width)}  # {src}" if src else t for t, src in lines]) + "\n"


def _type_name(field: FieldInfo) -> str:
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1
    if optional:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        name = " \\| ".join(f"`{toml_value(a)}`" for a in typing.get_args(annotation))
    else:
        name = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, "table")
    bounds = []
    for item in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{sign} {getattr(item, attr)}")
    return name + (" " + ", ".join(bounds) if bounds else "") + (", optional" if optional else "")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{toml_value(value)}`"


def _reference_table(model: type, prefix: str, flags: dict[str, str]) -> list[str]:
    rows = ["| key | type | default | command line | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name == "plugins":
            continue
        flag = flags.get(name, "")
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_name(field)} | {_default(field)} | {flag} | {description} |")
    return rows


def config_reference() -> str:
    """``docs/config.md``: every engine setting, generated from the pydantic models ``EngineConfig`` and
    ``PluginsConfig`` (``nanovllm config --reference > docs/config.md``)."""
    engine_flags = {
        n: ", ".join(
            f"`{flag.replace('--', '--[no-]', 1) if f.annotation is bool else flag}`" for flag in engine_flag_names(n)
        )
        for n, f in EngineConfig.model_fields.items()
        if n != "plugins"
    }
    engine_flags["model"] = "`--model`"
    engine_flags["async_scheduling"] = "`--async-scheduling [auto\\|on\\|off]`, `--no-async-scheduling`"
    plugin_flags = {
        "scheduler": "`--scheduler`",
        "block_manager": "`--block-manager`",
        "attention": "`--attention`, `--attention-backend`",
        "scheduler_options": "`--long-prefill-token-threshold N` (mixed, priority)",
        "structured_output_backend": "`--structured-outputs-backend`, `--guided-decoding-backend`",
    }
    example = {
        n: "/path/to/checkpoint" if n == "model" else EngineConfig.model_fields[n].get_default()
        for n in EngineConfig.model_fields
        if n != "plugins"
    }
    plugin_example = {
        n: PluginsConfig.model_fields[n].get_default(call_default_factory=True) for n in PluginsConfig.model_fields
    }
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from nanovllm_core.config by `nanovllm config --reference > docs/config.md`. Do not edit:"
        " tests/unit/test_cli.py fails when this file is out of date. -->",
        "",
        "The engine reads one configuration, validated by the pydantic model `nanovllm_core.EngineConfig`, from",
        "four layers; a later layer overrides an earlier one key by key (the `[plugins]` table merges key by key):",
        "",
        "1. the defaults below;",
        '2. a TOML file: `LLM(config="nanovllm.toml")`, `LLMEngine(config=...)`, `nanovllm ... --config FILE`',
        "   (the command line's `--config` also reads vLLM's YAML config, whose keys are flag names:",
        "   `max-model-len: 4096`; its values count as flags given before the others; PyYAML reads it);",
        '3. keyword arguments: `LLM(model, max_num_seqs=64, plugins={"scheduler": "fifo"})`;',
        "4. command-line flags of `nanovllm generate`, `nanovllm serve`, `nanovllm bench` and `nanovllm config`;",
        "   vLLM's spellings are accepted beside ours where the meaning is the same (the command-line column), and",
        "   vLLM's `--scheduling-policy fcfs|priority` selects the scheduler `mixed` (which schedules as vLLM's fcfs:",
        "   running requests' decode tokens first, the rest of the step filled with prompt chunks) or `priority`.",
        "",
        "An invalid value fails before any weights load, naming the field and what is allowed. Where the `plugins`",
        "table merges, so do its `*_options` tables, option by option.",
        "",
        'Values are checked strictly: each must already have its field\'s type, so `max_num_seqs = "64"` or',
        '`enforce_eager = "yes"` (in a file or as a keyword argument) is an error, not converted. An integer is',
        "accepted where a number is expected, and a path object for `model` and `tokenizer`. Command-line flags are",
        "parsed into their types first (`--max-num-seqs 64`, `--no-enforce-eager`). Plugin options are checked",
        "before any weights load too: strictly by the plugin's `Options` model when it has one, else by name",
        "against its constructor.",
        "",
        "Rules between fields: `max_num_seqs` must not exceed `max_num_batched_tokens` (every running sequence",
        "needs one token of the step's budget when it decodes); `max_model_len` must not exceed the model's",
        "`max_position_embeddings`.",
        "`nanovllm config --config FILE [flags]` prints the resolved configuration and where each value came from.",
        "",
        "## Engine",
        "",
        *_reference_table(EngineConfig, "", engine_flags),
        "",
        "## `[plugins]`",
        "",
        "Which plugin serves each role, by the name it registered (`nanovllm plugins` lists them), and the options",
        "handed to it as keyword arguments. A plugin class may declare its options as a pydantic model in a",
        "class attribute `Options`; unknown or invalid options then fail with the allowed ones.",
        "",
        *_reference_table(PluginsConfig, "plugins.", plugin_flags),
        "",
        "## A complete file with the defaults",
        "",
        "```toml",
        *[f"{k} = {toml_value(v)}" if v is not None else f"# {k} is unset by default" for k, v in example.items()],
        "",
        "[plugins]",
        *[f"{k} = {toml_value(v)}" for k, v in plugin_example.items()],
        "```",
        "",
    ]
    return "\n".join(out)


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config with the source of each value, or (``--reference``) the config reference."""
    if args.reference:
        sys.stdout.write(config_reference())
        return 0
    from nanovllm_core.config import read_config_file
    from nanovllm_core.engine.config_resolver import finish_config, load_config

    overrides = model_overrides(args)
    if "model" not in overrides and not (args.config and "model" in read_config_file(args.config)):
        raise ConfigError(
            'model is not set: put `model = "/path/to/checkpoint"` in the --config file or pass --model '
            "(`nanovllm config --reference` lists every field and its default)"
        )
    config = load_config(None, args.config, overrides, {})
    if (Path(config.model) / "config.json").is_file():
        config = finish_config(config)  # what generate and serve run with: every check of theirs, on this host
    else:
        check_before_loading(config)
    sys.stdout.write(render_config(config))
    return 0


def check_before_loading(config: EngineConfig) -> None:
    """For a model folder without a checkpoint (where the config cannot be finished): what can be checked without
    one, in the resolver's order and with its errors: the selected scheduler and block manager are installed; a
    named attention backend is installed; the plugins take the options given."""
    from nanovllm_core.engine.options import validate_options
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    plugins = config.plugins
    scheduler = registry.get("scheduler", plugins.scheduler).obj
    block_manager = registry.get("block_manager", plugins.block_manager).obj
    attention = registry.get("attention", plugins.attention).obj if plugins.attention != "auto" else None
    validate_options("scheduler", scheduler, plugins.scheduler_options)
    validate_options("block_manager", block_manager, plugins.block_manager_options)
    if attention is not None:
        validate_options("attention", attention, plugins.attention_options)
