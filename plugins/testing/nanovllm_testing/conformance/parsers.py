"""The reply parser kits: :class:`ToolParserConformance` and :class:`ReasoningParserConformance`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import ClassVar

from nanovllm_core.parsing import ReasoningParser, ToolParser
from nanovllm_core.plugins import check_registration


def _cuts(text: str) -> Iterator[list[str]]:
    """``text`` in one piece, a character a piece, and cut at every pair of places (a stream can cut anywhere)."""
    yield [text]
    yield list(text) or [""]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


class ToolParserConformance:
    """A tool parser (``nanovllm_register_tool_parsers``): on each of ``replies`` (texts in its format, with and
    without calls) its stream, cut anywhere, gives the content and the calls of ``parse``; the calls' arguments
    are JSON objects; a reply with no calls in it comes back as content, unchanged."""

    parser_cls: ClassVar[type[ToolParser]]
    replies: ClassVar[list[str]]
    plain_replies: ClassVar[list[str]] = ["Just an answer.", "", "a < b and c > d", "<tool <function x"]

    def test_is_a_tool_parser(self) -> None:
        problem = check_registration("tool_parser", self.parser_cls)
        assert problem is None, problem

    def test_replies_have_calls_with_json_object_arguments(self) -> None:
        for reply in self.replies:
            parsed = self.parser_cls().parse(reply)
            assert parsed.tool_calls, f"no call found in {reply!r}: make `replies` texts with calls"
            for call in parsed.tool_calls:
                assert call.name and isinstance(json.loads(call.arguments), dict), (reply, call)
        for reply in self.plain_replies:
            parsed = self.parser_cls().parse(reply)
            assert (parsed.content, parsed.tool_calls) == (reply, []), reply

    def test_a_stream_cut_anywhere_gives_what_parse_gives(self) -> None:
        for reply in self.replies + self.plain_replies:
            whole = self.parser_cls().parse(reply)
            for pieces in _cuts(reply):
                stream = self.parser_cls().new_stream()
                content, calls = "", []
                for piece in pieces:
                    more_content, more_calls = stream.feed(piece)
                    content, calls = content + more_content, calls + more_calls
                rest, last = stream.finish()
                content, calls = content + rest, calls + last
                assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
                assert content == (whole.content or "") or (whole.content is None and not content.strip()), (
                    f"{pieces!r}: content {content!r}, parse gives {whole.content!r}"
                )
                assert stream.num_calls == len(calls)


class ReasoningParserConformance:
    """A reasoning parser (``nanovllm_register_reasoning_parsers``): on each of ``replies`` its stream, cut
    anywhere, gives the thinking and the answer of ``parse``, and ``parse`` gives ``expected`` (one
    ``(thinking or None, answer)`` per reply)."""

    parser_cls: ClassVar[type[ReasoningParser]]
    replies: ClassVar[list[str]]
    expected: ClassVar[list[tuple[str | None, str]]]

    def test_is_a_reasoning_parser(self) -> None:
        problem = check_registration("reasoning_parser", self.parser_cls)
        assert problem is None, problem

    def test_parse_splits_as_expected(self) -> None:
        assert [self.parser_cls().parse(reply) for reply in self.replies] == self.expected

    def test_a_stream_cut_anywhere_gives_what_parse_gives(self) -> None:
        for reply in self.replies:
            thinking, answer = self.parser_cls().parse(reply)
            for pieces in _cuts(reply):
                stream = self.parser_cls().new_stream()
                got_thinking = got_answer = ""
                for piece in pieces:
                    more_thinking, more_answer = stream.feed(piece)
                    got_thinking, got_answer = got_thinking + more_thinking, got_answer + more_answer
                rest_thinking, rest_answer = stream.finish()
                got = (got_thinking + rest_thinking, got_answer + rest_answer)
                assert got == (thinking or "", answer), f"{pieces!r}: {got!r}, parse gives {(thinking, answer)!r}"
                assert stream.reasoned == (thinking is not None)
