"""The engine's flags, shared by ``generate``, ``serve`` and ``config`` (and plugin commands that run an engine:
``nanovllm-bench``'s ``bench``): one per EngineConfig field, with vLLM's spellings beside ours, and the overrides
they make."""

from __future__ import annotations

import argparse
import re
import typing
from decimal import Decimal
from typing import Any

from nanovllm_core.config import EngineConfig, PluginsConfig
from nanovllm_core.demo import DEMO_MAX_MODEL_LEN, ensure_demo_checkpoint

# --- engine flags, with vLLM's names beside ours ------------------------------------------------------

VLLM_FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "kvcache_block_size": ("--block-size",),
    "num_kvcache_blocks": ("--num-gpu-blocks-override",),
    "tensor_parallel_size": ("-tp",),
    "data_parallel_size": ("-dp",),
    "quantization": ("-q",),
}
"""More spellings of an EngineConfig field's flag: ``vllm serve``'s, where the meaning is the same."""

VLLM_ATTENTION_BACKENDS = {
    "TRITON_ATTN": "triton", "FLASH_ATTN": "flash_attn", "FLASHINFER": "flashinfer", "TORCH_SDPA": "torch"
}  # fmt: skip
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


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
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


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model`` or ``--demo``, one of them (``generate`` and ``config``; ``serve`` has a MODEL argument too)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="checkpoint folder (or set `model` in --config)")
    which.add_argument("--demo", action="store_true", help="the embedded tiny random-weight Qwen3 demo")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`cli_overrides` with the model: ``--model``'s, or with ``--demo`` the demo checkpoint (written on first
    use) and, unless set, a ``max_model_len`` that fits it."""
    overrides = cli_overrides(args)
    if args.demo:
        overrides["model"] = str(ensure_demo_checkpoint())
        overrides.setdefault("max_model_len", DEMO_MAX_MODEL_LEN)
    elif args.model:
        overrides["model"] = args.model
    return overrides


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
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

