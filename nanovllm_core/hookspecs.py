"""The hooks a nanovllm plugin implements. Each receives ``register(name, cls)`` and registers classes by name.

A plugin is a module whose hook implementations are marked with ``@nanovllm_core.hookimpl``; its distribution
announces it with an entry point in the ``nanovllm`` group, listed with the standard library's
:mod:`importlib.metadata` (what pluggy's ``load_setuptools_entrypoints`` uses; the old ``entrypoints`` package is
not used)::

    [project.entry-points.nanovllm]
    my_plugin = "my_package.plugin"

The module may declare which plugin API versions it supports (see ``nanovllm_core.PLUGIN_API_VERSION``); a
plugin that declares nothing is taken to support the core's current API, and one whose declaration excludes it
is reported as broken, naming both, while the other plugins still load::

    NANOVLLM_PLUGIN_API = ">=2,<3"

Every hook is called once per process, when the registry is first built (the engine builds it; so do
``nanovllm plugins`` and :func:`nanovllm_core.get_registry`). A hook implementation takes exactly one argument,
named ``register``; pluggy passes it by name. The registered object must be a class satisfying the interface of
its kind, otherwise the plugin is reported as broken. The authoring guide is ``docs/plugins.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "nanovllm"
PLUGIN_API_VERSION = 2  # bumped when a hook or an interface changes incompatibly
CORE_VERSION = "0.1.0"
ENTRY_POINT_GROUP = "nanovllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]
"""``register(name, cls)``: make ``cls`` selectable by ``name``; a name taken by another plugin is an error."""


@hookspec
def nanovllm_register_schedulers(register: Register) -> None:
    """Register scheduler classes: ``register("fifo", FifoScheduler)``.

    The class subclasses :class:`nanovllm_core.Scheduler` and is selected with ``[plugins] scheduler = "fifo"``;
    the engine builds it as ``cls(config, block_manager, **scheduler_options)`` (validated by an optional
    pydantic ``Options`` class attribute). It is a policy: it writes ``schedule()`` (and at most the queue hooks
    ``enqueue`` / ``requeue`` / ``remove_waiting``); the engine owns the requests, stops and aborts, and the base
    class owns the queues, ``postprocess``, ``preempt`` and ``finish``. The engine checks every step it returns
    (limits, new-token counts, blocks covering them, no empty step while work remains) and raises
    :class:`~nanovllm_core.errors.SchedulerError` naming the plugin;
    :class:`nanovllm_testing.conformance.SchedulerConformance` checks the rest (no starvation, exact outputs
    under preemption and abort, every block freed).
    """


@hookspec
def nanovllm_register_block_managers(register: Register) -> None:
    """Register block manager classes: ``register("prefix_cache", PrefixCachingBlockManager)``.

    The class subclasses :class:`nanovllm_core.BlockManager` and is selected with
    ``[plugins] block_manager = "prefix_cache"``; the engine builds it as
    ``cls(num_blocks, block_size, enable_prefix_caching=..., **block_manager_options)``.
    :class:`nanovllm_testing.conformance.BlockManagerConformance` checks its invariants.
    """


@hookspec
def nanovllm_register_attention_backends(register: Register) -> None:
    """Register attention backend classes: ``register("torch", TorchAttentionBackend)``.

    The class subclasses :class:`nanovllm_core.AttentionBackend`; it is selected with
    ``[plugins] attention = "torch"``, or picked by ``attention = "auto"`` when it is the available backend of
    highest ``priority`` (``check_available`` returns ``None`` and the block size is supported).
    :class:`nanovllm_testing.conformance.AttentionBackendConformance` compares it with a dense reference.
    """


@hookspec
def nanovllm_register_models(register: Register) -> None:
    """Register model classes by Hugging Face architecture name: ``register("Qwen3ForCausalLM", Qwen3ForCausalLM)``.

    The engine picks the class named by ``architectures[0]`` of the checkpoint's ``config.json``. It is an
    ``nn.Module`` following the :class:`nanovllm_core.CausalLM` protocol (``forward``, ``compute_logits``,
    ``load_weights``), built as ``cls(hf_config)``; its attention layers are :class:`nanovllm_core.layers.Attention`.
    :class:`nanovllm_testing.conformance.ModelConformance` compares its greedy output with ``transformers``.
    """


@hookspec
def nanovllm_register_structured_output_backends(register: Register) -> None:
    """Register structured-output backends (grammar engines): ``register("xgrammar", XgrammarBackend)``.

    The class subclasses :class:`nanovllm_core.StructuredOutputBackend` and is selected with
    ``[plugins] structured_output_backend = "xgrammar"`` (``--structured-outputs-backend``; ``auto`` takes the
    installed one of highest ``priority``). The engine builds it once, as
    ``cls(tokenizer, vocab_size, eos_token_ids, **structured_output_options)``, validates each constrained
    request with ``validate``, compiles each distinct constraint once with ``compile`` in a thread pool, and gives
    each sequence a grammar from ``new_grammar``, whose bitmask masks the logits before every sampling step.
    :class:`nanovllm_testing.conformance.StructuredOutputConformance` checks it.
    """


@hookspec
def nanovllm_register_tool_parsers(register: Register) -> None:
    """Register tool-call parser classes: ``register("hermes", HermesToolParser)``.

    The class subclasses :class:`nanovllm_core.ToolParser` (for a format that wraps each call
    in tags, :class:`nanovllm_core.TaggedToolParser`: set ``start`` and ``end`` and write
    ``parse_call``). ``nanovllm serve --enable-auto-tool-choice --tool-call-parser hermes`` selects it; the server
    builds it as ``cls()`` for each chat request with tools and ``tool_choice`` ``"auto"``, and reads the reply's
    ``content`` and ``tool_calls`` from it, a piece at a time in a stream.
    """


@hookspec
def nanovllm_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parser classes: ``register("qwen3", Qwen3ReasoningParser)``.

    The class subclasses :class:`nanovllm_core.ReasoningParser` (thinking inside tags at the
    reply's start: :class:`nanovllm_core.ThinkTagReasoningParser`, with its ``start``,
    ``end`` and ``opens_in_prompt``). ``nanovllm serve --reasoning-parser qwen3`` selects it; the server builds it
    as ``cls()`` for each chat request and returns the thinking as ``reasoning_content``.
    """


@hookspec
def nanovllm_register_commands(register: Register) -> None:
    """Register ``nanovllm`` subcommands: ``register("hello", HelloCommand)``.

    The class subclasses :class:`nanovllm_core.Command` (``help``, ``add_arguments(parser)``, ``run(args)``).
    ``nanovllm hello ...`` builds it as ``cls()``, adds its arguments to a subparser of its own and runs it; a
    name of a built-in command (``generate``, ``serve``, ``plugins``, ``config``) is not added, and says so on
    stderr.
    """


@hookspec
def nanovllm_register_quantization_methods(register: Register) -> None:
    """Register quantization methods by vLLM's name: ``register("fp8", Fp8Method)``.

    The class subclasses :class:`nanovllm_core.QuantizationMethod`. It is picked by ``quantization = "fp8"``
    (``--quantization``) or by the ``quant_method`` of a checkpoint's ``quantization_config``, and built once per
    model as ``cls(checkpoint_config)`` (the checkpoint's ``quantization_config``, or ``None`` for a 16-bit
    checkpoint to quantize at load). Its ``linear_method(prefix, layer)`` gives each linear layer of
    :mod:`nanovllm_core.layers.linear` a :class:`nanovllm_core.LinearMethod` (create the weights and scales,
    process them after loading, apply the product), so that model plugins never know which method runs.
    :class:`nanovllm_testing.conformance.QuantizationConformance` checks it.
    """


@hookspec
def nanovllm_register_data_parallel_backends(register: Register) -> None:
    """Register ways to run data-parallel replicas: ``register("mp", DataParallelClient)``.

    The class subclasses ``nanovllm_core.engine_client.base.EngineClient`` and is built as ``cls(config)`` with the
    finished config when ``data_parallel_size`` > 1 and ``data_parallel_backend`` (``--data-parallel-backend``)
    names it: it starts ``data_parallel_size`` replicas of the engine and serves ``LLM`` and ``AsyncLLM`` as one
    engine would. A class attribute ``finishes_config_on_replicas = True`` says the replicas finish the config
    where they run (Ray's actors: the front-end may have no GPU), and the front-end then takes the first
    replica's ``config``. ``nanovllm-data-parallel`` registers ``mp`` and ``ray`` (docs/scaling.md).
    """
