"""The engine configuration: one pydantic model, filled from defaults < config file < kwargs < CLI flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from nanovllm_core.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit integers (what ``torch.Generator.manual_seed`` takes)."""

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class FreezableModel(BaseModel):
    """A pydantic model whose fields can no longer be assigned once :meth:`freeze` ran (a copy made with
    ``model_copy`` stays frozen, and so does one that crossed a process boundary by pickle)."""

    _frozen: bool = PrivateAttr(default=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).model_fields and (getattr(self, "__pydantic_private__", None) or {}).get("_frozen"):
            raise ConfigError(
                f"{type(self).__name__}.{name} cannot be set: the configuration is finished, and every part of the "
                "engine reads the same values; give the value before the engine starts"
            )
        super().__setattr__(name, value)

    def freeze(self) -> None:
        """Refuse assignments to the fields from now on."""
        self._frozen = True


class PluginsConfig(FreezableModel):
    """Which plugin serves each role, by its registered name, and the options handed to it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    scheduler: str = Field("fifo", description="Scheduler policy, by registered name.")
    block_manager: str = Field("prefix_cache", description="KV block manager, by registered name.")
    attention: str = Field(
        "auto", description="Attention backend by registered name; `auto` picks the best available one."
    )
    scheduler_options: dict[str, Any] = Field(default_factory=dict, description="Options for the scheduler.")
    block_manager_options: dict[str, Any] = Field(default_factory=dict, description="Options for the block manager.")
    attention_options: dict[str, Any] = Field(default_factory=dict, description="Options for the attention backend.")
    structured_output_backend: str = Field(
        "auto",
        description="Grammar engine for structured output (JSON schema, regex, choice, grammar), by registered "
        "name; `auto` picks the installed one of highest priority, and none installed refuses constrained requests.",
    )
    structured_output_options: dict[str, Any] = Field(
        default_factory=dict, description="Options for the structured-output backend."
    )


class EngineConfig(FreezableModel):
    """Everything the engine needs to know before it loads a model.

    Invalid values raise :class:`ConfigError` naming the field and what is allowed, before any weights load.
    Validation is strict: a value must already have its field's type (``max_num_seqs="64"`` and
    ``enforce_eager="yes"`` are errors, not converted); an integer is accepted where a number is expected,
    and a path object where a path is. Command-line flags are parsed into their types first.

    :func:`nanovllm_core.engine.config_resolver.create_engine_config` finishes it once per process, before any
    engine client exists: ``max_model_len``, ``device``, ``dtype``, ``quantization`` and the attention and
    structured-output backends become what the engine runs with, and the object is frozen (:attr:`finished`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    model: str = Field(..., description="Path to a Hugging Face checkpoint folder (config.json + safetensors).")
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to `model`.")
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
        "repetition_penalty), as vLLM's flag: `auto` from the model folder's generation_config.json, `vllm` none "
        "(SamplingParams' own defaults), or a folder holding a generation_config.json.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` is `cuda` when available.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="`auto`: float32 on CPU; the checkpoint's dtype on CUDA (bfloat16 if it is float32)."
    )
    seed: int = Field(
        0, description="Seed for sampling of requests that set no seed of their own: 0 to 2**64 - 1 (64 bits)."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(16384, ge=1, description="Most new tokens in one step.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + output; defaults to the model's max_position_embeddings."
    )
    kvcache_block_size: int = Field(256, description="Tokens per KV-cache block: a power of two, 16 to 256.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="KV-cache element type. `auto`: the model's dtype; `fp8` (or vLLM's `fp8_e4m3`, read as `fp8`): "
        "float8 e4m3 with a float32 scale per token and KV head: about half the bytes, so twice the tokens in the "
        "same memory and half the KV for decode attention to read, for logits further from float32 than the bf16 "
        "cache's (docs/performance.md measures both); attention backends `triton` and `torch`.",
    )
    quantization: str | None = Field(
        None,
        description="How the linear layers' weights are stored and multiplied, by a quantization method's registered "
        "name (vLLM's --quantization): `fp8` quantizes a 16-bit checkpoint to FP8 W8A8 as it loads "
        "(nanovllm-quant-fp8). Unset: what the checkpoint's config.json says in its quantization_config (a checkpoint "
        "stored quantized), else none. A name that contradicts the checkpoint's is an error naming both.",
    )
    num_kvcache_blocks: int | None = Field(
        None, ge=1, description="Number of KV-cache blocks; when unset it is sized from free memory."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use (weights + activations + KV)."
    )
    cpu_kvcache_gib: float = Field(1.0, gt=0, description="KV-cache size on CPU when num_kvcache_blocks is unset.")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")
    cuda_graph_max_mixed_tokens: int = Field(
        8192,
        ge=0,
        description="Steps with prompt tokens (prefill chunks, alone or beside decode tokens) of up to this many "
        "tokens replay CUDA graphs captured per token-count bucket, with attention backends that support it "
        "(`triton`); larger ones run eagerly, bound by the host's launches until their GPU work outgrows them. "
        "0: only pure-decode steps use CUDA graphs.",
    )
    compile_small_ops: bool = Field(
        True,
        description="On CUDA, fuse the small ops: RMSNorm (with its residual add), SiLU-and-mul, q/k norm + rotary "
        "and temperature sampling with hand-written Triton kernels; the other norms and rotary with torch.compile.",
    )
    programmatic_dependent_launch: bool = Field(
        True,
        description="On GPUs of compute capability 9.0 and newer, launch the Triton kernels with programmatic "
        "dependent launch: a kernel starts launching while the one before it finishes, instead of after, which "
        "hides part of each launch in the chain of short kernels a decode step is.",
    )
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Schedule and prepare step N+1 while the device runs step N. `auto`: on for CUDA (any "
        "tensor_parallel_size); `on` also on CPU (no speed-up there, same tokens); `off`: one step at a time.",
    )
    step_records_file: str | None = Field(
        None,
        description="On CUDA, time every step on the GPU and write each step's shape and time to this JSON file at "
        "shutdown, the records `nanovllm simulate --calibrate` fits (as `nanovllm bench --json` writes them): "
        "calibrate the simulator on the steps a server really ran. It keeps two CUDA events a step: for "
        "measurement runs, not for a long-lived server.",
    )
    warmup: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run a few throw-away requests at start-up (a first step of max_num_batched_tokens prompt tokens, "
        "prompt chunks of several sizes, decode, greedy and temperature sampling) so that every kernel compiles and "
        "the largest activations are allocated before the first real request. `auto`: on CUDA.",
    )
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="GPUs (or CPU processes) to shard the model over.")
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Engine replicas, each a process of its own on `tensor_parallel_size` GPUs of its own (on CPU: "
        "a process each), requests balanced by load; needs data_parallel_size x tensor_parallel_size GPUs.",
    )
    data_parallel_backend: str = Field(
        "mp",
        description="How data-parallel replicas run, a data_parallel_backend plugin by name: `mp`, processes on this "
        "host; `ray`, Ray actors anywhere in a Ray cluster (both in nanovllm-data-parallel; `ray` with its `[ray]` "
        "extra; docs/scaling.md).",
    )
    ray_address: str | None = Field(
        None,
        description="With data_parallel_backend `ray`: the cluster to join (`ray.init(address=...)`, e.g. `auto` or "
        "`HOST:6379`); unset starts a local Ray runtime (or uses this process's Ray connection).",
    )
    ray_num_gpus_per_replica: float | None = Field(
        None,
        gt=0,
        description="With data_parallel_backend `ray` on GPUs: GPUs each replica actor reserves; defaults to "
        "tensor_parallel_size. A fraction (0.5) puts several replicas on one GPU, each taking that share of "
        "gpu_memory_utilization.",
    )
    ray_max_restarts: int = Field(
        3, ge=0, description="With data_parallel_backend `ray`: how often Ray restarts a replica actor that died."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("model", "tokenizer", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("seed")
    @classmethod
    def _seed_fits_64_bits(cls, value: int) -> int:
        if not 0 <= value <= MAX_SEED:
            raise ValueError(f"must be an unsigned 64-bit integer, 0 to 2**64 - 1 ({MAX_SEED})")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _one_name_for_e4m3(cls, value: str) -> str:
        return "fp8" if value == "fp8_e4m3" else value  # backends see one name per cache kind

    @field_validator("kvcache_block_size")
    @classmethod
    def _block_size_power_of_two(cls, value: int) -> int:
        if value < 16 or value > 256 or value & (value - 1):
            raise ValueError("must be a power of two from 16 to 256 (16, 32, 64, 128 or 256)")
        return value

    @model_validator(mode="after")
    def _gpus_for_the_tensor_parallel_ranks(self) -> EngineConfig:
        gpus, tp = self.ray_num_gpus_per_replica, self.tensor_parallel_size
        if gpus is not None and gpus < 1 and tp > 1:
            raise ValueError(
                f"ray_num_gpus_per_replica={gpus} shares a GPU between replicas; it needs tensor_parallel_size 1, "
                f"not {tp} (use a whole number of GPUs, at least tensor_parallel_size)"
            )
        if gpus is not None and 1 <= gpus < tp:
            raise ValueError(
                f"ray_num_gpus_per_replica={gpus} is fewer GPUs than tensor_parallel_size={tp} needs; allowed: at "
                f"least {tp}, or a fraction below 1 with tensor_parallel_size 1"
            )
        return self

    @model_validator(mode="after")
    def _consistent_limits(self) -> EngineConfig:
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running sequence needs one token per decode step"
            )
        return self

    @classmethod
    def load(
        cls,
        config_file: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        cli_overrides: dict[str, Any] | None = None,
    ) -> EngineConfig:
        """Merge defaults < ``config_file`` (TOML) < ``overrides`` (kwargs) < ``cli_overrides``.

        ``plugins`` tables merge key by key, so ``plugins={"attention": "torch"}`` keeps the file's scheduler, and
        so do their ``*_options`` tables, option by option.
        The result remembers where each top-level value came from in :attr:`sources`.
        """
        layers: list[tuple[str, dict[str, Any]]] = []
        if config_file is not None:
            layers.append((f"file {config_file}", read_config_file(config_file)))
        if overrides:
            layers.append(("keyword argument", dict(overrides)))
        if cli_overrides:
            layers.append(("command line", dict(cli_overrides)))
        merged: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for source, values in layers:
            for key, value in values.items():
                if key == "plugins" and isinstance(value, dict):
                    plugins = dict(merged.get("plugins", {}))
                    for sub, sub_value in value.items():
                        # the options tables merge option by option too, so that one flag such as
                        # --long-prefill-token-threshold keeps the file's other scheduler options
                        if sub.endswith("_options") and isinstance(sub_value, dict):
                            earlier = plugins.get(sub)
                            sub_value = {**(earlier if isinstance(earlier, dict) else {}), **sub_value}
                        plugins[sub] = sub_value
                        sources[f"plugins.{sub}"] = source
                    merged["plugins"] = plugins
                else:
                    merged[key] = value
                    sources[key] = source
        try:
            config = cls(**merged)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None
        config._sources = sources
        return config

    @property
    def finished(self) -> bool:
        """Whether the resolver finished this config: its values are the ones the engine runs with, and it is
        frozen."""
        return self._frozen

    def finished_copy(self, values: dict[str, Any], plugin_values: dict[str, Any]) -> EngineConfig:
        """A frozen copy with ``values`` (and ``plugin_values`` in ``plugins``) set, marked finished: what the
        resolver returns. The values are the resolver's own decisions, valid by construction."""
        plugins = self.plugins.model_copy(update=plugin_values)
        plugins.freeze()
        finished = self.model_copy(update={**values, "plugins": plugins})
        sources = dict(self._sources)
        changed = [(k, getattr(self, k), v) for k, v in values.items()]
        changed += [(f"plugins.{k}", getattr(self.plugins, k), v) for k, v in plugin_values.items()]
        for key, before, after in changed:
            if after != before:
                given = "unset" if before is None else repr(before)
                sources[key] = f"resolved; {self.source_of(key)} gave {given}"
        finished._sources = sources
        finished.freeze()
        return finished

    def source_of(self, key: str) -> str:
        """Where a value came from: ``default``, ``file PATH``, ``keyword argument`` or ``command line``; in a finished
        config, ``resolved; SOURCE gave VALUE`` for a value the resolver decided (``auto``, unset)."""
        return self._sources.get(key, "default")


YAML_SUFFIXES = (".yaml", ".yml")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML config file's table; a clear :class:`ConfigError` for a missing, unreadable or invalid file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the path of a TOML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.suffix in YAML_SUFFIXES:
        raise ConfigError(
            f"config file {str(path)!r}: a YAML file (vLLM's config, keys are flag names) is read by the --config "
            "of nanovllm generate, serve, bench and config only; elsewhere give a TOML file (or keyword arguments)"
        )
    if path.suffix not in (".toml", ""):
        raise ConfigError(f"config file {str(path)!r}: only TOML files (.toml) are supported")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "TOML files are UTF-8: save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None


def describe_error(err: ErrorDetails) -> str:
    """One pydantic error as ``message (got value)``; a strict-mode type error says that nothing is converted."""
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" and "ctx" in err else err["msg"]
    if err["type"] in _STRICT_TYPE_ERRORS and isinstance(err.get("input"), str):
        msg += "; strings are not converted (write the value without quotes)"
    if "input" in err and err["type"] != "missing":
        msg = f"{msg} (got {err['input']!r})"
    return msg


_STRICT_TYPE_ERRORS = frozenset({"int_type", "float_type", "bool_type"})


def format_validation_error(exc: ValidationError) -> str:
    lines = ["invalid engine configuration:"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            allowed = (
                ", ".join(EngineConfig.model_fields) if "." not in field else ", ".join(PluginsConfig.model_fields)
            )
            msg = f"unknown field; allowed fields: {allowed}"
        else:
            msg = describe_error(err)
        lines.append(f"  {field}: {msg}")
    return "\n".join(lines)
