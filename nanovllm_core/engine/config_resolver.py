"""Finishing the engine configuration, once per process, before any engine client exists (vLLM's
``EngineArgs.create_engine_config()``).

:func:`create_engine_config` takes what the entry points take (a model, a TOML file or an :class:`EngineConfig`,
keyword overrides, command-line overrides), merges them (defaults < file < keywords < flags) and finishes the result:
``max_model_len`` from the checkpoint, ``device`` and ``dtype`` concrete, the quantization method chosen, the
attention and structured-output backends selected by name, the plugins' options validated. Every check that must
pass before weights load runs here, so a bad configuration fails before any process or engine starts. The finished
config is frozen; the engine clients, data-parallel replicas and the engine core receive it and resolve nothing again
(a finished config passed to the resolver comes back as it is). The one exception is a data-parallel backend whose
replicas may run on nodes with a device the front-end lacks (Ray's): each replica finishes the config there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.kv_cache import model_shape
from nanovllm_core.engine.options import validate_options
from nanovllm_core.engine.structured_output import select_structured_output_backend
from nanovllm_core.errors import ConfigError, ModelLoadError, UnknownPluginError
from nanovllm_core.interfaces import AttentionBackend
from nanovllm_core.loader import checkpoint_quantization_config, load_hf_config
from nanovllm_core.plugins import PluginRegistry, get_registry, installed_architecture, none_installed_hint

__all__ = [
    "create_engine_config",
    "finish_config",
    "load_config",
    "resolve_device",
    "resolve_dtype",
    "select_attention_backend",
    "select_quantization",
]

DEFAULT_MAX_MODEL_LEN = 4096  # for a checkpoint whose config.json gives no max_position_embeddings


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; allowed here: 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = getattr(torch, checkpoint, None)
    return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


def select_attention_backend(
    registry: PluginRegistry,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
) -> type[AttentionBackend]:
    def problem(cls: type[AttentionBackend]) -> str | None:
        reason = cls.check_available(device, dtype, head_dim)
        if reason is None and cls.supported_block_sizes() is not None and block_size not in cls.supported_block_sizes():
            reason = f"kvcache_block_size {block_size} unsupported (supported: {cls.supported_block_sizes()})"
        return reason or cls.check_kv_cache_dtype(kv_cache_dtype, device)

    if name != "auto":
        cls = registry.get("attention", name).obj
        reason = problem(cls)
        if reason is not None:
            usable = [r.name for r in registry.registrations["attention"].values() if problem(r.obj) is None]
            raise ConfigError(
                f"attention backend {name!r} cannot run here: {reason}; "
                f"backends that can: {', '.join(usable) or 'none'}"
            )
        return cls
    candidates = sorted(registry.registrations["attention"].values(), key=lambda r: -getattr(r.obj, "priority", 0))
    reasons = []
    for reg in candidates:
        reason = problem(reg.obj)
        if reason is None:
            return reg.obj
        reasons.append(f"{reg.name}: {reason}")
    if not candidates:
        raise ConfigError(f"no attention backend is installed; {none_installed_hint('attention')}")
    installed = ", ".join(r.name for r in candidates)
    raise ConfigError(f"no attention backend runs on {device} / {dtype} (installed: {installed}): {'; '.join(reasons)}")


def select_quantization(
    registry: PluginRegistry, configured: str | None, hf_config: Any, model: str, device: torch.device
) -> str | None:
    """The quantization method the model loads with: ``configured`` (``quantization``), else the ``quant_method``
    of the checkpoint's ``quantization_config``, else None. Checked before any weight loads: the method is
    installed, agrees with the checkpoint, can read a 16-bit checkpoint when given one, and runs on ``device``."""
    checkpoint = checkpoint_quantization_config(hf_config)
    stored = None
    if checkpoint is not None:
        stored = checkpoint.get("quant_method")
        if not isinstance(stored, str) or not stored:
            raise ModelLoadError(
                f"{model}/config.json has a quantization_config without a quant_method (got {stored!r}); it names "
                "the method that wrote the checkpoint (fp8, compressed-tensors, ...)"
            )
    if configured is not None and stored is not None and configured != stored:
        raise ConfigError(
            f"quantization={configured!r} contradicts the checkpoint, whose config.json says quant_method "
            f"{stored!r}: leave quantization unset to load it as stored, or give a 16-bit checkpoint"
        )
    name = configured or stored
    if name is None:
        return None
    try:
        cls = registry.get("quantization", name).obj
    except UnknownPluginError as exc:
        if configured is None:
            raise UnknownPluginError(f"{model} is stored quantized with {name!r}: {exc}") from None
        raise
    if checkpoint is None and not cls.quantizes_on_load:
        raise ConfigError(
            f"quantization {name!r} reads checkpoints stored quantized with it, and {model} is a 16-bit checkpoint "
            "(its config.json has no quantization_config); `nanovllm plugins` lists the methods that quantize at load"
        )
    reason = cls.check_available(device)
    if reason is not None:
        raise ConfigError(f"quantization {name!r} cannot run on {device}: {reason}")
    return name


def load_config(
    model: str | None,
    config: str | Path | EngineConfig | None,
    cli_overrides: dict[str, Any] | None,
    kwargs: dict[str, Any],
) -> EngineConfig:
    """The :class:`EngineConfig` of an entry point's arguments, merged but not finished: ``config`` as it is when it
    is one (then nothing else may be given), else defaults < ``config`` (a TOML file) < ``kwargs`` (``model`` among
    them) < ``cli_overrides``."""
    if isinstance(config, EngineConfig):
        if model is not None or kwargs or cli_overrides:
            raise ConfigError("give either an EngineConfig or a model, a config file and overrides, not both")
        return config
    overrides = dict(kwargs) if model is None else {**kwargs, "model": model}
    return EngineConfig.load(config, overrides, cli_overrides)


def create_engine_config(
    model: str | None = None,
    config: str | Path | EngineConfig | None = None,
    *,
    cli_overrides: dict[str, Any] | None = None,
    **kwargs: Any,
) -> EngineConfig:
    """The finished config of an entry point's arguments (:func:`load_config`, then :func:`finish_config`): what
    every entry point calls once, before it makes an engine client."""
    return finish_config(load_config(model, config, cli_overrides, kwargs))


def finish_config(config: EngineConfig) -> EngineConfig:
    """``config`` finished (see the module's text) and frozen; a finished one is returned as it is, and so is one
    whose Ray replicas finish it (:func:`finishes_on_the_cluster`).

    Raises what the engine raised before loading weights, in the same order: ConfigError, UnknownPluginError or
    ModelLoadError (a plugin that is not installed, an architecture without a model plugin, ``max_model_len``
    beyond the model's positions, a device, dtype, quantization or attention backend that cannot run here, invalid
    plugin options, a missing structured-output backend)."""
    if config.finished or finishes_on_the_cluster(config):
        return config
    registry = get_registry()
    plugins = config.plugins
    scheduler_cls = registry.get("scheduler", plugins.scheduler).obj
    block_manager_cls = registry.get("block_manager", plugins.block_manager).obj
    hf_config = load_hf_config(config.model)
    arch = installed_architecture(registry, config.model, getattr(hf_config, "architectures", None))
    registry.get("model", arch)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = max_positions or DEFAULT_MAX_MODEL_LEN
    elif max_positions and max_model_len > max_positions:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({max_positions})"
        )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    quantization = select_quantization(registry, config.quantization, hf_config, config.model, device)
    _, _, _, head_dim = model_shape(hf_config)
    attention_cls = select_attention_backend(
        registry, plugins.attention, device, dtype, head_dim, config.kvcache_block_size, config.kv_cache_dtype
    )
    validate_options("scheduler", scheduler_cls, plugins.scheduler_options)
    validate_options("block_manager", block_manager_cls, plugins.block_manager_options)
    validate_options("attention", attention_cls, plugins.attention_options)
    structured_cls = select_structured_output_backend(registry, plugins.structured_output_backend)
    plugin_values = {"attention": registered_name(registry, "attention", attention_cls)}
    if structured_cls is not None:
        validate_options("structured_output", structured_cls, plugins.structured_output_options)
        plugin_values["structured_output_backend"] = registered_name(registry, "structured_output", structured_cls)
    values = {
        "max_model_len": max_model_len,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
    }
    return config.finished_copy(values, plugin_values)


def finishes_on_the_cluster(config: EngineConfig) -> bool:
    """Whether ``config`` runs data-parallel replicas whose backend finishes the config on each replica's node
    (``finishes_config_on_replicas``: Ray actors, where the front-end may have no GPU); the front-end then takes
    the first replica's. A backend that is not installed fails here, naming its distribution."""
    if config.data_parallel_size == 1:
        return False
    backend = get_registry().get("data_parallel_backend", config.data_parallel_backend).obj
    return bool(getattr(backend, "finishes_config_on_replicas", False))


def registered_name(registry: PluginRegistry, kind: str, cls: type) -> str:
    """The name ``cls`` is registered under as a ``kind`` plugin (what the config names it by)."""
    return next(name for name, reg in registry.registrations[kind].items() if reg.obj is cls)
