"""The core's own reply parsers, registered as a plugin like anyone's (the ``nanovllm`` entry point
``builtin_parsers`` of ``nanovllm-core``): the ``hermes`` tool-call parser and the ``qwen3`` and ``deepseek_r1``
reasoning parsers."""

from __future__ import annotations

from nanovllm_core.hookspecs import Register, hookimpl
from nanovllm_core.parsing.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from nanovllm_core.parsing.tool_calls import HermesToolParser

NANOVLLM_PLUGIN_API = ">=2,<3"


@hookimpl
def nanovllm_register_tool_parsers(register: Register) -> None:
    register("hermes", HermesToolParser)


@hookimpl
def nanovllm_register_reasoning_parsers(register: Register) -> None:
    register("qwen3", Qwen3ReasoningParser)
    register("deepseek_r1", DeepSeekR1ReasoningParser)
