"""The ``nanovllm`` command: ``generate``, ``plugins``, ``bench``."""

from __future__ import annotations

import argparse
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any

from nanovllm_core.config import EngineConfig, PluginsConfig
from nanovllm_core.errors import NanoVLLMError

DEMO_PROMPTS = ["Hello world!", "The quick brown fox", "To be or not to be, that is the question."]


def demo_checkpoint_dir() -> Path:
    cache = Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))
    return cache / "demo-qwen3-tiny"


def ensure_demo_checkpoint() -> Path:
    """The embedded demo: a tiny random-weight Qwen3 written on first use (no download is possible)."""
    path = demo_checkpoint_dir()
    if not (path / "config.json").is_file():
        from nanovllm_core.testing import write_tiny_checkpoint

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
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=field.description)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, dest=name, default=None, choices=typing.get_args(base), help=field.description)
        else:
            parser.add_argument(flag, dest=name, default=None, type=base if base in (int, float) else str,
                                help=field.description)
    for name in ("scheduler", "block_manager", "attention"):
        parser.add_argument("--" + name.replace("_", "-"), dest=f"plugin_{name}", default=None,
                            help=PluginsConfig.model_fields[name].description)


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name in EngineConfig.model_fields:
        value = getattr(args, name, None)
        if value is not None and name not in ("plugins",):
            overrides[name] = value
    plugins = {n: getattr(args, f"plugin_{n}") for n in ("scheduler", "block_manager", "attention")
               if getattr(args, f"plugin_{n}", None) is not None}
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
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed_request)
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
    totals = llm.stats.totals
    prefill = totals["prefill_tokens"] / totals["prefill_s"] if totals["prefill_s"] else 0.0
    decode = totals["decode_tokens"] / totals["decode_s"] if totals["decode_s"] else 0.0
    print(f"{num_out} output tokens in {elapsed:.2f} s: {num_out / elapsed:,.1f} tok/s "
          f"(prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s; attention backend "
          f"{llm.attention_backend_name!r}, device {llm.device})")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    rows = [("kind", "name", "distribution", "version", "module")]
    rows += [(r.kind, r.name, r.distribution, r.version, r.module) for r in registry.all()]
    widths = [max(len(str(row[i])) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for broken in registry.broken:
        print(f"BROKEN  {broken.plugin} ({broken.distribution} {broken.version}): {broken.error}")
    return 1 if registry.broken else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A small vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("--model", help="checkpoint folder (or set `model` in --config)")
    gen.add_argument("--demo", action="store_true", help="use the embedded tiny random-weight Qwen3 demo")
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

    plugins = sub.add_parser("plugins", help="list installed plugins and what each registers")
    plugins.set_defaults(func=cmd_plugins)

    bench = sub.add_parser("bench", help="throughput benchmark (nano-vllm's workload)")
    bench.add_argument("--model", help="checkpoint folder; default: random weights of --shape")
    _add_bench_flags(bench)
    _add_engine_flags(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from nanovllm_core.benchmark import add_bench_arguments

    add_bench_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm_core.benchmark import run_bench

    return run_bench(args, _cli_overrides(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NanoVLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
