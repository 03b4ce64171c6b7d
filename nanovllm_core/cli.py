"""The ``nanovllm`` command: ``generate``, ``bench``, ``plugins``, ``config``; each takes ``--config FILE``."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import types
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from nanovllm_core.config import YAML_SUFFIXES, EngineConfig, PluginsConfig
from nanovllm_core.demo import DEMO_MAX_MODEL_LEN, ensure_demo_checkpoint
from nanovllm_core.errors import ConfigError, NanoVLLMError

DEMO_PROMPTS = ["Hello world!", "The quick brown fox", "To be or not to be, that is the question."]


# --- engine flags, with vLLM's names beside ours ------------------------------------------------------

VLLM_FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "kvcache_block_size": ("--block-size",),
    "num_kvcache_blocks": ("--num-gpu-blocks-override",),
    "tensor_parallel_size": ("-tp",),
    "data_parallel_size": ("-dp",),
}
"""More spellings of an EngineConfig field's flag: ``vllm serve``'s, where the meaning is the same."""

VLLM_ATTENTION_BACKENDS = {"TRITON_ATTN": "triton", "FLASH_ATTN": "flash_attn", "TORCH_SDPA": "torch"}
"""vLLM's ``--attention-backend`` values that have a backend here, and its name here."""

VLLM_SCHEDULING_POLICIES = {"fcfs": "mixed", "priority": "priority"}
"""vLLM's ``--scheduling-policy`` -> the scheduler here that behaves like it. vLLM's fcfs schedules the running
requests' decode tokens first and fills the step with prompt chunks: that is ``mixed`` (``fifo`` runs prompts
alone, in steps of their own)."""

VLLM_DTYPES = {"half": "float16", "float": "float32"}
"""vLLM's ``--dtype`` aliases."""


def attention_backend(value: str) -> str:
    """``--attention`` / ``--attention-backend``: a backend registered here, or vLLM's name of one that maps."""
    if value in VLLM_ATTENTION_BACKENDS:
        return VLLM_ATTENTION_BACKENDS[value]
    if re.fullmatch(r"[A-Z][A-Z0-9_]*", value):  # vLLM's spelling of a backend this engine does not have
        known = ", ".join(f"{k} ({v})" for k, v in VLLM_ATTENTION_BACKENDS.items())
        raise argparse.ArgumentTypeError(
            f"vLLM's attention backend {value!r} has no counterpart here; vLLM's names that do: {known}, or give a "
            "backend's name here (`nanovllm plugins` lists them; auto picks one)"
        )
    return value


def scheduling_policy(value: str) -> str:
    """``--scheduling-policy``: vLLM's policy name -> the scheduler that behaves like it."""
    if value not in VLLM_SCHEDULING_POLICIES:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a scheduling policy; allowed: fcfs (the mixed scheduler), priority "
            "(--scheduler names any installed scheduler)"
        )
    return VLLM_SCHEDULING_POLICIES[value]


def dtype_name(value: str) -> str:
    """``--dtype``: our names, and vLLM's aliases ``half`` and ``float``."""
    return VLLM_DTYPES.get(value, value)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG])")
_HUMAN_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(value: str) -> int:
    """``--max-model-len``: an integer, or vLLM's short forms: ``32k`` is 32,000, ``32K`` 32,768 (k, m, g decimal;
    K, M, G binary), ``25.6k`` 25,600."""
    match = _HUMAN_INT.fullmatch(value.strip())
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not an integer; allowed: digits, or with k/m/g (x1000) or K/M/G (x1024), e.g. 32k"
            ) from None
    number, unit = match.groups()
    result = Decimal(number) * _HUMAN_UNITS[unit]  # exact: 25.6k is 25,600, not a float a hair off it
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of tokens")
    return int(result)


def engine_flag_names(name: str) -> list[str]:
    """Every spelling of an EngineConfig field's flag, ours first."""
    return ["--" + name.replace("_", "-"), *VLLM_FLAG_ALIASES.get(name, ())]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (and ``--scheduler`` etc. for plugins), with vLLM's spellings beside
    (:data:`VLLM_FLAG_ALIASES`); unset flags stay unset."""
    parser.add_argument(
        "--config", help="config file: TOML (nanovllm's keys), or YAML (vLLM's: keys are flag names); flags override it"
    )
    for name, field in EngineConfig.model_fields.items():
        if name in ("plugins", "model"):
            continue
        flags = engine_flag_names(name)
        annotation = field.annotation
        args = typing.get_args(annotation)
        base = next((a for a in args if a is not type(None)), annotation) if args else annotation
        if name == "async_scheduling":
            # vLLM's bare --async-scheduling / --no-async-scheduling, beside our auto|on|off
            parser.add_argument(
                *flags, dest=name, default=None, nargs="?", const="on", choices=("auto", "on", "off"),
                help=f"{field.description} A bare --async-scheduling is `on` (vLLM's flag).",
            )  # fmt: skip
            parser.add_argument(
                "--no-async-scheduling", dest=name, action="store_const", const="off", help="async_scheduling `off`"
            )
        elif base is bool:
            parser.add_argument(
                *flags, dest=name, default=None, action=argparse.BooleanOptionalAction, help=field.description
            )
        elif name == "max_model_len":
            parser.add_argument(
                *flags, dest=name, default=None, type=human_readable_int,
                help=f"{field.description} As in vLLM, `32k` is 32,000 and `32K` 32,768.",
            )  # fmt: skip
        elif name == "dtype":
            parser.add_argument(
                *flags, dest=name, default=None, type=dtype_name,
                help=f"{field.description} vLLM's `half` and `float` are `float16` and `float32`.",
            )  # fmt: skip
        else:
            parser.add_argument(
                *flags, dest=name, default=None, type=base if base in (int, float) else str, help=field.description
            )
    parser.add_argument(
        "--scheduler", dest="plugin_scheduler", default=None, help=PluginsConfig.model_fields["scheduler"].description
    )
    parser.add_argument(
        "--scheduling-policy",
        dest="plugin_scheduler",
        type=scheduling_policy,
        metavar="{fcfs,priority}",
        help="vLLM's flag: fcfs selects the mixed scheduler (decode tokens of running requests first, the rest of "
        "the step filled with prompt chunks, as vLLM's fcfs), priority the priority scheduler",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="most tokens one prompt chunk may take in a step (vLLM's flag): the scheduler option of mixed and "
        "priority (--scheduling-policy fcfs or priority)",
    )
    parser.add_argument(
        "--block-manager",
        dest="plugin_block_manager",
        default=None,
        help=PluginsConfig.model_fields["block_manager"].description,
    )
    parser.add_argument(
        "--attention",
        "--attention-backend",
        dest="plugin_attention",
        type=attention_backend,
        default=None,
        help=PluginsConfig.model_fields["attention"].description
        + " vLLM's names that map: "
        + ", ".join(f"{k} ({v})" for k, v in VLLM_ATTENTION_BACKENDS.items())
        + ".",
    )
    parser.add_argument(
        "--structured-outputs-backend",
        "--guided-decoding-backend",
        dest="plugin_structured_output_backend",
        default=None,
        metavar="NAME",
        help=PluginsConfig.model_fields["structured_output_backend"].description
        + " vLLM's flag (--guided-decoding-backend: its older name).",
    )


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name in EngineConfig.model_fields:
        value = getattr(args, name, None)
        if value is not None and name not in ("plugins",):
            overrides[name] = value
    plugins: dict[str, Any] = {
        n: getattr(args, f"plugin_{n}")
        for n in ("scheduler", "block_manager", "attention", "structured_output_backend")
        if getattr(args, f"plugin_{n}", None) is not None
    }
    threshold = getattr(args, "long_prefill_token_threshold", None)
    if threshold is not None:
        plugins["scheduler_options"] = {"long_prefill_token_threshold": threshold}
    if plugins:
        overrides["plugins"] = plugins
    return overrides


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm_core import LLM, SamplingParams

    overrides = _cli_overrides(args)
    if args.demo:
        overrides["model"] = str(ensure_demo_checkpoint())
        overrides.setdefault("max_model_len", 512)
    elif args.model:
        overrides["model"] = args.model
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed_request,
    )
    llm = LLM(config=args.config, cli_overrides=overrides)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    num_out = 0
    for out in outputs:
        completion = out.outputs[0]
        num_out += len(completion.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        if out.error:
            print(f"    error: {out.error}")
        else:
            print(f"    output: {completion.text!r}  ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    if outputs and all(out.error for out in outputs):
        print(f"error: every prompt failed ({len(outputs)} of {len(outputs)})", file=sys.stderr)
        return 1
    if llm.config.data_parallel_size > 1:  # the engines run in replica processes: only their stats are here
        details = (
            f"{llm.config.data_parallel_size} data-parallel replicas; KV cache {llm.stats().num_kv_blocks} blocks of "
            f"{llm.config.kvcache_block_size} tokens in all"
        )
    else:
        details = (
            f"{llm.step_stats.rates_text()}; attention backend {llm.attention_backend_name!r}, device {llm.device}, "
            f"KV cache {llm.runner.num_kvcache_blocks} blocks of {llm.config.kvcache_block_size} tokens"
        )
    print(f"{num_out} output tokens in {elapsed:.2f} s: {num_out / elapsed:,.1f} tok/s ({details})")
    return 0


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def cmd_plugins(args: argparse.Namespace) -> int:
    """The installed plugins, what each registers, the config's selection (``*``), the broken ones, and each role
    (scheduler, block manager, attention backend, model) that no installed plugin fills, with what to install."""
    from nanovllm_core.config import read_config_file
    from nanovllm_core.plugins import conflict_message, get_registry, missing_hint, none_installed_hint

    registry = get_registry()
    table = read_config_file(args.config).get("plugins", {}) if args.config else {}
    try:
        selection = PluginsConfig(**table)
    except ValueError as exc:
        raise ConfigError(f"[plugins] of {args.config}: {exc}") from None
    selected = {
        "scheduler": selection.scheduler,
        "block_manager": selection.block_manager,
        "attention": selection.attention,
    }
    rows = [("", "kind", "name", "distribution", "version", "module")]
    rows += [
        (
            ("*" if selected.get(r.kind) == r.name else "") + ("!" if r.name in registry.conflicts[r.kind] else ""),
            r.kind, r.name, r.distribution, r.version, r.module,
        )
        for r in registry.all()
    ]
    for line in _table(rows):
        print(line)
    source = f"file {args.config}" if args.config else "the defaults"
    print("\n* selected by " + source + ": " + ", ".join(f"{k} = {v!r}" for k, v in selected.items()))
    status = 0
    conflicts = [clashing for kind in registry.conflicts.values() for clashing in kind.values()]
    if conflicts:
        print("\n! conflicts (these names cannot be selected; every other name still works):")
        for clashing in conflicts:
            print(f"  {conflict_message(clashing)}")
        status = 1
    for kind, name in selected.items():
        if name in registry.conflicts[kind]:
            print(f"error: the selected {kind} {name!r} is registered by more than one plugin (see above)")
            status = 1
        elif kind == "attention" and name == "auto":
            if not registry.registrations[kind]:
                print(f"error: no attention backend is installed; {none_installed_hint(kind)}")
                status = 1
        elif name not in registry.registrations[kind]:
            installed = ", ".join(registry.names(kind)) or "none"
            print(f"error: {kind} {name!r} is not installed (installed: {installed}). {missing_hint(kind, name)}")
            status = 1
    # the model is picked from the checkpoint's architecture, so no name is selected: at least one must exist
    if not registry.registrations["model"] and not registry.conflicts["model"]:
        print(f"error: no model is installed; {none_installed_hint('model')}")
        status = 1
    if registry.broken:
        print("\nbroken plugins (not loaded):")
        for broken in registry.broken:
            where = " ".join(x for x in (broken.distribution, broken.version) if x)
            print(f"  {broken.plugin} ({where}): {broken.error}")
        status = 1
    return status


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
        "Values are checked strictly: each must already have its field's type, so `max_num_seqs = \"64\"` or",
        "`enforce_eager = \"yes\"` (in a file or as a keyword argument) is an error, not converted. An integer is",
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

    overrides = _cli_overrides(args)
    if args.demo:
        overrides["model"] = str(ensure_demo_checkpoint())
        overrides.setdefault("max_model_len", DEMO_MAX_MODEL_LEN)
    elif args.model:
        overrides["model"] = args.model
    if "model" not in overrides and not (args.config and "model" in read_config_file(args.config)):
        raise ConfigError(
            'model is not set: put `model = "/path/to/checkpoint"` in the --config file or pass --model '
            "(`nanovllm config --reference` lists every field and its default)"
        )
    config = EngineConfig.load(args.config, cli_overrides=overrides)
    check_before_loading(config)
    sys.stdout.write(render_config(config))
    return 0


def check_before_loading(config: EngineConfig) -> None:
    """What the engine checks before any weights load, beyond the config's own fields, in the engine's order and
    with its errors: the selected scheduler and block manager are installed; when the model folder has a
    config.json, its architecture has a model plugin and ``max_model_len`` fits it; a named attention backend is
    installed; the plugins take the options given. Left to the engine, which knows its device: whether a named
    attention backend runs there, and which backend ``auto`` picks (so the options of ``auto``'s pick)."""
    from nanovllm_core.engine.options import validate_options
    from nanovllm_core.errors import ModelLoadError
    from nanovllm_core.plugins import get_registry, installed_architecture

    registry = get_registry()
    plugins = config.plugins
    scheduler = registry.get("scheduler", plugins.scheduler).obj
    block_manager = registry.get("block_manager", plugins.block_manager).obj
    hf_config_file = Path(config.model) / "config.json"
    if hf_config_file.is_file():
        try:
            hf_config = json.loads(hf_config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{hf_config_file} cannot be read as JSON: {exc}") from None
        installed_architecture(registry, config.model, hf_config.get("architectures"))
        max_positions = hf_config.get("max_position_embeddings")
        if config.max_model_len is not None and max_positions and config.max_model_len > max_positions:
            raise ConfigError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings ({max_positions})"
            )
    attention = registry.get("attention", plugins.attention).obj if plugins.attention != "auto" else None
    validate_options("scheduler", scheduler, plugins.scheduler_options)
    validate_options("block_manager", block_manager, plugins.block_manager_options)
    if attention is not None:
        validate_options("attention", attention, plugins.attention_options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A small vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions for prompts. Exits 1 when every prompt failed.",
    )
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--model", help="checkpoint folder (or set `model` in --config)")
    which.add_argument("--demo", action="store_true", help="use the embedded tiny random-weight Qwen3 demo")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--seed-request", type=int, default=None, help="sampling seed of every request")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    plugins = sub.add_parser(
        "plugins",
        help="list installed plugins, what each registers, and broken ones",
        description="List every registered name with its distribution, version and module; * marks the "
        "config's selection, ! a name that two plugins register. Exits 1 when a plugin is broken, a name "
        "conflicts or a selected name is not installed (everything is listed all the same), else 0.",
    )
    plugins.add_argument("--config", help="TOML config file whose [plugins] selection is marked with *")
    plugins.set_defaults(func=cmd_plugins)

    config = sub.add_parser(
        "config",
        help="show the resolved config and where each value came from",
        description="Print the resolved engine configuration and where each value came from, after the checks "
        "`generate` and `serve` make before loading weights (plugins installed, their options, the model folder's "
        "architecture and length when it exists). Exits 2 on an invalid configuration.",
    )
    config_which = config.add_mutually_exclusive_group()
    config_which.add_argument("--model", help="checkpoint folder (or set `model` in --config)")
    config_which.add_argument("--demo", action="store_true", help="the embedded tiny random-weight Qwen3 demo")
    config.add_argument("--reference", action="store_true", help="print the config reference (docs/config.md)")
    _add_engine_flags(config)
    config.set_defaults(func=cmd_config)

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
    _add_engine_flags(bench)
    bench.set_defaults(func=cmd_bench)
    bench_modes = bench.add_subparsers(dest="bench_mode", metavar="serve", help="`bench serve`: load a running server")
    bench_serve = bench_modes.add_parser(
        "serve",
        help="load a running OpenAI-compatible server (nanovllm serve) and report its latencies",
        description="Serving benchmark (vLLM's benchmark_serving metrics) against a running server.",
    )
    _add_serving_flags(bench_serve, bench=True)
    bench_serve.set_defaults(func=cmd_bench_serve)

    serve = sub.add_parser(
        "serve",
        help="serve MODEL over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics. Stops on SIGTERM/SIGINT: in-flight requests get --shutdown-timeout seconds, then exit 0.",
    )
    _add_serving_flags(serve, bench=False)
    _add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    simulate = sub.add_parser(
        "simulate",
        help="judge a scheduler policy on a workload without a GPU (simulated time, calibrated step costs)",
        description="Replay a workload through the real engine core and the installed scheduler and block-manager "
        "plugins, each step's duration from a GPU calibration; reports bench serve's metrics. --calibrate fits a "
        "calibration from nanovllm bench --json results.",
    )
    _add_simulate_flags(simulate)
    simulate.set_defaults(func=cmd_simulate)
    return parser


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.bench.offline import add_bench_arguments

    add_bench_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm_core.bench.offline import run_bench

    overrides = _cli_overrides(args)
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


def _add_serving_flags(parser: argparse.ArgumentParser, bench: bool) -> None:
    if bench:
        from nanovllm_core.serving.bench import add_bench_serve_arguments as add
    else:
        from nanovllm_core.serving.serve import add_serve_arguments as add
    add(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from nanovllm_core.serving.serve import run_serve

    return run_serve(args, _cli_overrides(args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from nanovllm_core.serving.bench import run_bench_serve

    return run_bench_serve(args)


def _add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.simulate.run import add_simulate_arguments

    add_simulate_arguments(parser)


def cmd_simulate(args: argparse.Namespace) -> int:
    from nanovllm_core.simulate.run import run_simulate

    return run_simulate(args)


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
    parser = build_parser()
    command_parser = _subcommand_parser(parser, argv[0]) if argv else None
    found = _yaml_config_in(argv) if argv and argv[0] in ("generate", "serve", "config", "bench") else None
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
    except NanoVLLMError as exc:  # a YAML config that cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except NanoVLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
