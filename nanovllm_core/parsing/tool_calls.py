"""Tool calls in a chat model's output (vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME``).

A :class:`ToolParser` turns the text a model wrote into the message's ``content`` and its ``tool_calls``; its
stream (:meth:`ToolParser.new_stream`) does the same a delta at a time. Parsers are plugins: a plugin registers
a subclass with the ``nanovllm_register_tool_parsers`` hook and ``--tool-call-parser NAME`` selects it.

Formats that wrap each call in tags subclass :class:`TaggedToolParser` and say how one call's text reads: content
comes out as it arrives (holding back what may be the start of the opening tag), each call whole once its closing
tag has arrived, and a block that does not read as a call, or never closes, stays in the content as written.

``hermes`` (in the core): the format of Hermes models and of Qwen2.5 / Qwen3, whose chat templates describe it to
the model: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when the model wrote nothing but tool calls (and whitespace)
    tool_calls: list[ParsedToolCall]


class ToolCallStream(ABC):
    """One reply's parse, a piece at a time; ``num_calls`` counts the calls given out so far."""

    num_calls: int = 0

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The content and the complete tool calls that ``text`` (the next piece of the reply) makes available."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the reply: the content and calls still held back."""


class ToolParser(ABC):
    """Reads the tool calls in a chat reply. Built with no arguments, once per request."""

    @abstractmethod
    def new_stream(self) -> ToolCallStream:
        """A fresh parse of one reply."""

    def parse(self, text: str) -> ParsedMessage:
        """A whole reply: what its stream gives for it in one piece."""
        stream = self.new_stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        content += rest
        calls += more
        return ParsedMessage(content if content.strip() or not calls else None, calls)


class TaggedToolParser(ToolParser):
    """A format that wraps each call in ``start`` ... ``end`` tags; subclasses say how one call's text reads."""

    start: ClassVar[str]
    end: ClassVar[str]

    @abstractmethod
    def parse_call(self, body: str) -> ParsedToolCall | None:
        """The call written between the tags (stripped), or None if it is not one (it stays content)."""

    def new_stream(self) -> ToolCallStream:
        return TaggedToolCallStream(self)


def json_call(name: object, arguments: object) -> ParsedToolCall | None:
    """A call from a JSON name and arguments (an object, or a JSON string of one), or None if they are not."""
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(TaggedToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number, anywhere in the reply."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str) -> ParsedToolCall | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict):
            return None
        return json_call(call.get("name"), call.get("arguments", call.get("parameters", {})))


class TaggedToolCallStream(ToolCallStream):
    """The stream of a :class:`TaggedToolParser`."""

    def __init__(self, parser: TaggedToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet given out: a possible tag start, or an open call's body
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.pending += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        start, end = self.parser.start, self.parser.end
        while True:
            if not self.in_call:
                at = self.pending.find(start)
                if at < 0:
                    cut = len(self.pending) - partial_suffix(self.pending, start)
                    content.append(self.pending[:cut])
                    self.pending = self.pending[cut:]
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
        rest, self.pending, self.in_call = self.pending, "", False  # an unclosed call stays content, as written
        return rest, []


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
