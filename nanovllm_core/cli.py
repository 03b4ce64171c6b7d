"""The ``nanovllm`` command: ``generate``, ``bench``, ``plugins``, ``config``; each takes ``--config FILE``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from nanovllm_core.config import EngineConfig, PluginsConfig
from nanovllm_core.errors import ConfigError, NanoVLLMError

DEMO_PROMPTS = ["Hello world!", "The quick brown fox", "To be or not to be, that is the question."]


def demo_checkpoint_dir() -> Path:
    cache = Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))
    return cache / "demo-qwen3-tiny"


def ensure_demo_checkpoint() -> Path:
    """The embedded demo: a tiny random-weight Qwen3 written on first use (no download is possible)."""
    path = demo_checkpoint_dir()
    if not (path / "config.json").is_file():
        from nanovllm_core.demo import write_tiny_checkpoint

        print(f"writing the demo checkpoint (tiny random-weight Qwen3) to {path}", file=sys.stderr)
        write_tiny_checkpoint(path, "qwen3", hidden_size=128, intermediate_size=256, num_layers=4)
    return path


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (and ``--scheduler`` etc. for plugins); unset flags stay unset."""
    parser.add_argument("--config", help="TOML config file (CLI flags override it)")
    for name, field in EngineConfig.model_fields.items():
        if name in ("plugins", "model"):
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        args = typing.get_args(annotation)
        base = next((a for a in args if a is not type(None)), annotation) if args else annotation
        if base is bool:
            parser.add_argument(
                flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=field.description
            )
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, dest=name, default=None, choices=typing.get_args(base), help=field.description)
        else:
            parser.add_argument(
                flag, dest=name, default=None, type=base if base in (int, float) else str, help=field.description
            )
    for name in ("scheduler", "block_manager", "attention"):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"plugin_{name}",
            default=None,
            help=PluginsConfig.model_fields[name].description,
        )


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name in EngineConfig.model_fields:
        value = getattr(args, name, None)
        if value is not None and name not in ("plugins",):
            overrides[name] = value
    plugins = {
        n: getattr(args, f"plugin_{n}")
        for n in ("scheduler", "block_manager", "attention")
        if getattr(args, f"plugin_{n}", None) is not None
    }
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
        flag = f"`{flags[name]}`" if name in flags else ""
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_name(field)} | {_default(field)} | {flag} | {description} |")
    return rows


def config_reference() -> str:
    """``docs/config.md``: every engine setting, generated from the pydantic models ``EngineConfig`` and
    ``PluginsConfig`` (``nanovllm config --reference > docs/config.md``)."""
    engine_flags = {
        n: ("--[no-]" if f.annotation is bool else "--") + n.replace("_", "-")
        for n, f in EngineConfig.model_fields.items()
        if n != "plugins"
    }
    engine_flags["model"] = "--model"
    plugin_flags = {n: "--" + n.replace("_", "-") for n in ("scheduler", "block_manager", "attention")}
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
        '2. a TOML file: `LLM(config="nanovllm.toml")`, `LLMEngine(config=...)`, `nanovllm ... --config FILE`;',
        '3. keyword arguments: `LLM(model, max_num_seqs=64, plugins={"scheduler": "fifo"})`;',
        "4. command-line flags of `nanovllm generate`, `nanovllm bench` and `nanovllm config`.",
        "",
        "An invalid value fails before any weights load, naming the field and what is allowed.",
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
    if args.model:
        overrides["model"] = args.model
    if "model" not in overrides and not (args.config and "model" in read_config_file(args.config)):
        raise ConfigError(
            'model is not set: put `model = "/path/to/checkpoint"` in the --config file or pass --model '
            "(`nanovllm config --reference` lists every field and its default)"
        )
    config = EngineConfig.load(args.config, cli_overrides=overrides)
    sys.stdout.write(render_config(config))
    return 0


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

    config = sub.add_parser("config", help="show the resolved config and where each value came from")
    config.add_argument("--model", help="checkpoint folder (or set `model` in --config)")
    config.add_argument("--reference", action="store_true", help="print the config reference (docs/config.md)")
    _add_engine_flags(config)
    config.set_defaults(func=cmd_config)

    bench = sub.add_parser("bench", help="throughput benchmark (nano-vllm's workload)")
    bench.add_argument("--model", help="checkpoint folder; default: random weights of --shape")
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
    return parser


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.bench.offline import add_bench_arguments

    add_bench_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm_core.bench.offline import run_bench

    return run_bench(args, _cli_overrides(args))


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NanoVLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
