"""From a constraint (a kind and its text, as :attr:`StructuredOutputsParams.spec` writes it) to llguidance's
grammar text, and llguidance's error messages to one line."""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

ANY_OBJECT_SCHEMA = '{"type": "object"}'
MAX_MESSAGE_CHARS = 400  # a reason is shown to the client and logged: a schema echoed whole would drown it

_CARET = re.compile(r"\^+")  # the marker under the fault in an echoed source line
_SOURCE = re.compile(r"\d+ \|")  # a numbered line of llguidance's excerpt of the grammar
_POSITION = re.compile(r"^at \d+\(\d+\): ")  # line(column) in the grammar llguidance wrapped the spec in


def grammar_text(kind: str, spec: str, json_options: dict[str, Any], disable_additional_properties: bool) -> str:
    """llguidance's grammar for a constraint (not yet checked: see ``LLMatcher.validate_grammar``).

    Raises ``ValueError`` for a spec that cannot even be read: JSON that does not parse, choices that are not a
    list of strings, a grammar that is neither Lark nor GBNF. ``json_options`` are llguidance's JSON compile
    options, applied as defaults so that a schema's own ``x-guidance`` settings win.
    """
    if kind == "json":
        schema = _load_json(spec, "the JSON schema")
        if schema is True:  # any JSON value; llguidance applies its options to object schemas only
            schema = {}
        elif schema is False:
            raise ValueError("the JSON schema is false: no value satisfies it")
        elif not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object (or true/false)")
        if disable_additional_properties:
            schema = forbid_additional_properties(schema)
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=json_options)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=json_options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(choice_lark(_load_json(spec, "the choices")))
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(_to_lark(spec))
    raise ValueError(f"unknown constraint kind {kind!r}")


def choice_lark(choices: Any) -> str:
    """A Lark grammar whose sentences are exactly ``choices``.

    Each choice is a Lark string literal written by ``json.dumps``: llguidance reads JSON's escapes in literals,
    and the ASCII-only form keeps every quote, backslash, control character and non-ASCII character (as
    ``\\uXXXX``, surrogate pairs included) out of the grammar's own syntax.
    """
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices are a non-empty JSON list of non-empty strings")
    for i, choice in enumerate(choices):
        try:
            choice.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"choice {i} is not valid Unicode text (a lone surrogate)") from None
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def forbid_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that lists ``properties`` (or ``patternProperties``) and
    says nothing of ``additionalProperties`` gets ``additionalProperties: false`` (vLLM's
    ``disable-additional-properties``): the output then holds only the keys the schema names."""
    if isinstance(schema, list):
        return [forbid_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: forbid_additional_properties(value) for key, value in schema.items()}
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


def one_line(message: str, keep_position: bool = True) -> str:
    """llguidance's message on one line, without its echo of the grammar.

    Its errors name the fault, then quote the source with a ``^`` under it, over several lines. The quoted
    lines (and the line each caret points into) are dropped; what remains is joined. ``keep_position=False``
    drops the leading ``at line(column):``, which for a regex, schema or choice points into the grammar
    llguidance built around it, not into anything the user wrote.
    """
    lines = [line.strip() for line in message.splitlines()]
    kept = []
    for i, line in enumerate(lines):
        pointed_at = i + 1 < len(lines) and _CARET.fullmatch(lines[i + 1]) is not None
        if line and not _CARET.fullmatch(line) and not _SOURCE.match(line) and not pointed_at:
            kept.append(line)
    text = " ".join(kept) or " ".join(message.split())
    if not keep_position:
        text = _POSITION.sub("", text)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 1] + "…"
    return text


def _load_json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def _to_lark(text: str) -> str:
    """The grammar as Lark: as it is when it has a ``start`` rule (or llguidance's ``%llguidance`` header), else
    converted from GBNF (llama.cpp's ``root ::= ...``), as vLLM's guidance backend reads grammars."""
    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter raises plain Exception for some user errors (a missing rule)
        raise ValueError(
            f"a grammar is Lark with a `start` rule, or GBNF with a `root` rule; read as GBNF: {exc}"
        ) from None
