"""nanovllm core: hookspecs, plugin registries, config, the engine, the model runner and reusable layers.

Public API for users::

    from nanovllm_core import LLM, SamplingParams

and for plugin authors: :data:`hookimpl`, the interfaces in :mod:`nanovllm_core.interfaces`, the layers in
:mod:`nanovllm_core.layers`, :func:`nanovllm_core.loader.load_weights` and :mod:`nanovllm_testing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanovllm_core.commands import Command
from nanovllm_core.config import EngineConfig, PluginsConfig
from nanovllm_core.errors import (
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    NanoVLLMError,
    PluginConflictError,
    PluginError,
    SchedulerError,
    UnknownPluginError,
)
from nanovllm_core.hookspecs import CORE_VERSION, PLUGIN_API_VERSION, hookimpl
from nanovllm_core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    BlockManager,
    CausalLM,
    Scheduler,
    SchedulerOutput,
)
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.parsing import ParsedToolCall, ReasoningParser, TaggedToolParser, ThinkTagReasoningParser, ToolParser
from nanovllm_core.plugins import get_registry, register_plugin, unregister_plugin
from nanovllm_core.quantization import LinearMethod, QuantizationMethod
from nanovllm_core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from nanovllm_core.structured_output import StructuredOutputBackend, StructuredOutputGrammar, bitmask_words

if TYPE_CHECKING:
    from nanovllm_core.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from nanovllm_core.entrypoints.llm import LLM
    from nanovllm_core.entrypoints.llm_engine import LLMEngine
    from nanovllm_core.serving.async_llm import AsyncLLM

__version__ = CORE_VERSION

# The engine, the model runner and the server load on first use of these names (PEP 562), so that importing
# nanovllm_core, its hookspecs or its interfaces (what a plugin does) costs only those modules.
_LAZY = {
    "AsyncLLM": "nanovllm_core.serving.async_llm",
    "BeamSearchOutput": "nanovllm_core.engine.beam_search",
    "BeamSearchParams": "nanovllm_core.engine.beam_search",
    "BeamSearchSequence": "nanovllm_core.engine.beam_search",
    "LLM": "nanovllm_core.entrypoints.llm",
    "LLMEngine": "nanovllm_core.entrypoints.llm_engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Command",
    "LLM",
    "AsyncLLM",
    "PLACEHOLDER_TOKEN",
    "PLUGIN_API_VERSION",
    "AttentionBackend",
    "AttentionBatch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockManager",
    "CausalLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "LinearMethod",
    "ModelLoadError",
    "NanoVLLMError",
    "PluginConflictError",
    "PluginError",
    "ParsedToolCall",
    "PluginsConfig",
    "QuantizationMethod",
    "ReasoningParser",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "Scheduler",
    "SchedulerError",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputsParams",
    "TaggedToolParser",
    "ThinkTagReasoningParser",
    "ToolParser",
    "UnknownPluginError",
    "bitmask_words",
    "get_registry",
    "hookimpl",
    "register_plugin",
    "unregister_plugin",
]
