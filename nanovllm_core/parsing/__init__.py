"""Chat replies parsed into what the OpenAI API returns: tool calls (:mod:`.tool_calls`) and a reasoning model's
thinking (:mod:`.reasoning`). Both kinds of parser are plugins (``nanovllm_register_tool_parsers``,
``nanovllm_register_reasoning_parsers``); the core's own are registered by :mod:`.builtin`."""

from nanovllm_core.parsing.reasoning import ReasoningParser, ReasoningStream, ThinkTagReasoningParser
from nanovllm_core.parsing.tool_calls import ParsedToolCall, TaggedToolParser, ToolCallStream, ToolParser

__all__ = [
    "ParsedToolCall",
    "ReasoningParser",
    "ReasoningStream",
    "TaggedToolParser",
    "ThinkTagReasoningParser",
    "ToolCallStream",
    "ToolParser",
]
