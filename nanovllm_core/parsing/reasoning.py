"""A reasoning model's thinking apart from its answer (vLLM's ``--reasoning-parser NAME``): chat replies carry the
thinking as ``reasoning_content`` and the rest as ``content``.

A :class:`ReasoningParser` splits a whole reply; its stream (:meth:`ReasoningParser.new_stream`) splits one that
arrives in pieces the same way. Parsers are plugins: a plugin registers a subclass with the
``nanovllm_register_reasoning_parsers`` hook and ``--reasoning-parser NAME`` selects it. In the core, both on
``<think>...</think>`` (:class:`ThinkTagReasoningParser`; a block that never closes is thinking to the end):

- ``qwen3``: a reply that opens with ``<think>`` (after any whitespace) thinks until ``</think>``; one that does
  not is all answer (Qwen3 with ``enable_thinking=False``: its template closes an empty block in the prompt).
- ``deepseek_r1``: the reply thinks from its first character (the chat template opened the block in the prompt;
  a ``<think>`` the model writes anyway is dropped) until ``</think>``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from nanovllm_core.parsing.tool_calls import partial_suffix


class ReasoningStream(ABC):
    """One reply's split, a piece at a time; ``reasoned``: whether the reply has a thinking part."""

    reasoned: bool = False

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """The thinking and the answer that ``text`` (the next piece of the reply) makes available."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """At the end of the reply: the thinking and the answer still held back."""


class ReasoningParser(ABC):
    """Splits a chat reply into thinking and answer. Built with no arguments, once per request."""

    @abstractmethod
    def new_stream(self) -> ReasoningStream:
        """A fresh split of one reply."""

    def parse(self, text: str) -> tuple[str | None, str]:
        """(thinking, or None for a reply without a thinking part; answer) of a whole reply."""
        stream = self.new_stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning if stream.reasoned else None), content + more_content


class ThinkTagReasoningParser(ReasoningParser):
    """Thinking inside ``start`` ... ``end`` tags at the reply's beginning; ``opens_in_prompt``: the chat template
    wrote the opening tag, so the reply starts inside the block."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    opens_in_prompt: ClassVar[bool] = False

    def new_stream(self) -> ReasoningStream:
        return ThinkTagStream(self)


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    opens_in_prompt = False


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    opens_in_prompt = True


class ThinkTagStream(ReasoningStream):
    """The stream of a :class:`ThinkTagReasoningParser`."""

    def __init__(self, parser: ThinkTagReasoningParser) -> None:
        self.start, self.end = parser.start, parser.end
        self.state = "inside" if parser.opens_in_prompt else "opening"  # then "answer"
        self.skip_start = parser.opens_in_prompt  # an opening tag the model writes anyway is dropped
        self.reasoned = parser.opens_in_prompt
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = ""
        start = self.start
        if self.state == "opening":
            stripped = self.pending.lstrip()
            if stripped.startswith(start):
                self.state, self.reasoned = "inside", True
                self.pending = stripped[len(start) :]
            elif not start.startswith(stripped):  # cannot become the opening tag any more: all answer
                self.state = "answer"
            else:
                return "", ""  # whitespace or a start of the tag so far
        if self.state == "inside":
            if self.skip_start:
                stripped = self.pending.lstrip()
                if stripped.startswith(start):
                    self.pending, self.skip_start = stripped[len(start) :], False
                elif start.startswith(stripped):
                    return "", ""
                else:
                    self.skip_start = False
            at = self.pending.find(self.end)
            if at < 0:
                cut = len(self.pending) - partial_suffix(self.pending, self.end)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(self.end) :]
            self.state = "answer"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""  # inside an unclosed block it is thinking
        return (rest, "") if self.state == "inside" else ("", rest)
