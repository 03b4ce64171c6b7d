"""A reasoning model's thinking apart from its answer (vLLM's ``--reasoning-parser NAME``): chat replies carry the
text inside ``<think>...</think>`` as ``reasoning_content`` and the rest as ``content``.

- ``qwen3``: a reply that opens with ``<think>`` (after any whitespace) reasons until ``</think>``; one that does
  not is all answer (Qwen3 with ``enable_thinking=False``: its template closes an empty block in the prompt).
- ``deepseek_r1``: the reply reasons from its first character (the chat template opened the block in the prompt;
  a ``<think>`` the model writes anyway is dropped) until ``</think>``.

In both, a block that never closes is reasoning to the end. A :class:`ReasoningStream` splits a reply that
arrives in pieces the same way, holding back only what may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm_core.serving.tool_calls import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # deepseek_r1: the reply starts inside the block

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole reply."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        return (reasoning if stream.reasoned else None), content + more_content


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", opens_in_prompt=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_prompt=True),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; a ValueError names the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Splits a reply that arrives in pieces into reasoning and content."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.state = "inside" if parser.opens_in_prompt else "opening"  # then "answer"
        self.skip_start = parser.opens_in_prompt  # a <think> the model writes anyway is dropped
        self.reasoned = parser.opens_in_prompt
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next piece) makes available."""
        self.pending += text
        reasoning = content = ""
        if self.state == "opening":
            stripped = self.pending.lstrip()
            if stripped.startswith(START):
                self.state, self.reasoned = "inside", True
                self.pending = stripped[len(START) :]
            elif not START.startswith(stripped):  # cannot become "<think>" any more: all answer
                self.state = "answer"
            else:
                return "", ""  # whitespace or a start of the tag so far
        if self.state == "inside":
            if self.skip_start:
                stripped = self.pending.lstrip()
                if stripped.startswith(START):
                    self.pending, self.skip_start = stripped[len(START) :], False
                elif START.startswith(stripped):
                    return "", ""
                else:
                    self.skip_start = False
            at = self.pending.find(END)
            if at < 0:
                cut = len(self.pending) - partial_suffix(self.pending, END)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(END) :]
            self.state = "answer"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end of the reply: what is still held back (inside an unclosed block it is reasoning)."""
        rest, self.pending = self.pending, ""
        if self.state == "inside":
            return rest, ""
        return "", rest
