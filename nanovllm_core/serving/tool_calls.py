"""Tool calls in a chat model's output (vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME``).

A parser turns the text a model wrote into the message's ``content`` and its ``tool_calls``; for a stream, a
:class:`ToolCallStream` does the same a delta at a time: content as it comes (holding back what may be the start
of a tool-call tag), each tool call whole once its closing tag has arrived.

``hermes``: the format of Hermes models and of Qwen2.5 / Qwen3 (their chat templates describe it to the model):
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, content is the text outside them.
A call whose JSON does not parse, or that is never closed, stays in the content as written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when the model wrote nothing but tool calls
    tool_calls: list[ParsedToolCall]


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number, anywhere in the text."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str) -> ParsedToolCall | None:
        """One block's JSON as a call, or None if it is not ``{"name": str, "arguments": object}``."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string already
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))

    def parse(self, text: str) -> ParsedMessage:
        stream = ToolCallStream(self)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        content += rest
        calls += more
        return ParsedMessage(content if content.strip() or not calls else None, calls)


TOOL_PARSERS = {"hermes": HermesToolParser}


def tool_parser(name: str) -> HermesToolParser:
    """The parser called ``name``; a ValueError names the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()


class ToolCallStream:
    """Splits a text that arrives in pieces into content and tool calls, as ``parser.parse`` does the whole."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet given out: a possible tag start, or an open call's body
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The content and the complete tool calls that ``text`` (the next piece) makes available."""
        self.pending += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        start, end = self.parser.start, self.parser.end
        while True:
            if not self.in_call:
                at = self.pending.find(start)
                if at < 0:
                    keep = partial_suffix(self.pending, start)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                content.append(self.pending[:at])
                self.pending = self.pending[at:]
                self.in_call = True
            at = self.pending.find(end)
            if at < 0:
                break
            block = self.pending[: at + len(end)]
            call = self.parser.parse_call(block[len(start) : at].strip())
            if call is None:
                content.append(block)  # not a call after all: the text as written
            else:
                calls.append(call)
                self.num_calls += 1
            self.pending = self.pending[at + len(end) :]
            self.in_call = False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the text: what is still held back (an unclosed call stays content, as written)."""
        rest, self.pending, self.in_call = self.pending, "", False
        return rest, []


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
