"""``xgrammar``: the structured-output backend on the ``xgrammar`` grammar engine.

A constraint becomes an xgrammar grammar, is compiled once against the tokenizer (``GrammarCompiler``: token
masks precomputed per grammar position, so a step's mask is cheap) and is walked per sequence by a
``GrammarMatcher``, which writes the allowed tokens straight into the engine's int32 bitmask (xgrammar's own
layout, which the core adopted).

``xgrammar`` is imported when the backend is built, not when this module is: the plugin registry imports every
plugin's module in every process that lists plugins or builds an engine, and most of them never constrain output.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from nanovllm_core.engine.options import validate_options
from nanovllm_core.structured_output import StructuredOutputBackend, StructuredOutputGrammar, bitmask_words

MAX_REASON_CHARS = 240  # an invalid constraint's reason is one line of an HTTP 400 body, not a parser dump
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any JSON object (xgrammar's built-in JSON grammar
# also admits arrays, which OpenAI's json_object does not)

# xgrammar (through 0.2.9 at least; its issue 800) writes each character of a string with minLength / maxLength
# as this class, which lets raw control characters (a tab, NUL) into a JSON string: invalid JSON. The backend
# swaps in JSON's class of unescaped characters (no escapes either way, as xgrammar's `pattern` strings).
LENGTH_BOUNDED_CHAR = r"[^\"\\\r\n]"
JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

# rows x tokenizer tokens from which a step's masks are computed on xgrammar's threads: starting them costs
# about as much as a few rows of a large vocabulary, and far more than a whole batch of a small one
PARALLEL_FILL_WORK = 2_000_000

_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:94: " of C++ errors
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")
_NOISE = (" The JSON string is:", "Stack trace:", "Traceback")  # a repeated input or a native stack: cut there


def one_line_reason(exc: BaseException) -> str:
    """xgrammar's error as one short line: no log prefix, no internal check text, no echoed input or stack."""
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(exc)))
    for marker in _NOISE:
        text = text.split(marker, 1)[0]
    text = " ".join(text.split()).rstrip(":")
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 3] + "..."
    return text or type(exc).__name__


def ebnf_string_literal(text: str) -> str:
    """``text`` as a quoted string literal of xgrammar's EBNF: quote, backslash and control characters escaped,
    the rest (non-ASCII included) written as itself, which the EBNF parser reads as UTF-8."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch < " " or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def choice_ebnf(spec: str) -> str:
    """The EBNF grammar ``root ::= "a" | "b" ...`` of a choice spec (a JSON list of non-empty strings)."""
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"choices are not a JSON list: {exc}") from None
    if not isinstance(choices, list) or not choices:
        raise ValueError("choices must be a non-empty JSON list of strings")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"every choice must be a non-empty string, got {choice!r:.60}")
        try:
            choice.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"choice {choice!r:.60} is not valid Unicode (a lone surrogate)") from None
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in dict.fromkeys(choices))


def token_row(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One bitmask row (int32 words) allowing exactly ``token_ids`` (those below ``vocab_size``)."""
    words = [0] * bitmask_words(vocab_size)
    for t in token_ids:
        if 0 <= t < vocab_size:
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def special_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special tokens: its named ones and every added token marked special."""
    ids = {t for t in getattr(tokenizer, "all_special_ids", ()) if isinstance(t, int)}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return ids


@dataclass(frozen=True)
class TokenRules:
    """What the backend enforces on top of xgrammar's mask, shared by every grammar of one backend.

    xgrammar matches a special token by its text (``<|pad|>`` is seven characters to it), so inside a JSON string
    or a permissive regex it would allow one, and the output's text would then lose it (special tokens are
    skipped when detokenizing) or hold a control token the constraint never meant. Stop tokens get the same text
    treatment in some grammar states, where xgrammar allows (and accepts) one before the constraint is complete.
    So: special tokens other than the stop tokens are never allowed, and the stop tokens exactly when the matcher
    says the constraint is complete.
    """

    stop_ids: frozenset[int]
    banned_ids: frozenset[int]
    stop_row: torch.Tensor  # only the stop tokens: the mask once terminated, and OR-ed in when complete
    keep_row: torch.Tensor  # every token but the stop and banned ones (no bit past the vocabulary): AND-ed into
    # each mask xgrammar writes, which in permissive states sets the last word's bits past the vocabulary

    @classmethod
    def build(cls, stop_ids: Iterable[int], banned_ids: Iterable[int], vocab_size: int) -> TokenRules:
        stop = frozenset(t for t in stop_ids if 0 <= t < vocab_size)
        banned = frozenset(t for t in banned_ids if 0 <= t < vocab_size) - stop
        keep = token_row(range(vocab_size), vocab_size) & ~token_row(stop | banned, vocab_size)
        return cls(stop, banned, token_row(stop, vocab_size), keep)


class XgrammarGrammar(StructuredOutputGrammar):
    """One sequence's ``xgrammar.GrammarMatcher``, with the backend's :class:`TokenRules` applied.

    xgrammar ends a matcher by accepting a stop token (the engine's EOS ids) once the constraint is complete; after
    that it refuses to compute a mask, so ``fill_bitmask`` then writes the EOS-only row itself, as the contract asks.
    """

    def __init__(self, matcher: Any, backend: XgrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend
        self.rules = backend.rules
        self.tokenizer_size = backend.tokenizer_size

    def accept_tokens(self, request_id: str, tokens: Iterable[int]) -> bool:
        matcher, rules, size = self.matcher, self.rules, self.tokenizer_size
        for token in tokens:
            if not 0 <= token < size or token in rules.banned_ids:
                return False
            if token in rules.stop_ids and not matcher.is_completed():
                return False
            if not matcher.accept_token(token):  # xgrammar leaves the matcher where it was on a rejected token
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.backend.fill_bitmasks([self], bitmask[index : index + 1])

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Every constraint kind on xgrammar: JSON schemas (``compile_json_schema``), regular expressions, choices
    and grammars in xgrammar's EBNF (GBNF, llama.cpp's notation, root rule ``root``).

    The mask is ``vocab_size`` wide (the model's): tokens past the tokenizer's vocabulary, and the tokenizer's
    special tokens other than the EOS ids, are never allowed. Compiling is thread-safe and releases the GIL, so
    the engine's compile pool runs constraints in parallel; xgrammar also caches compiled grammars by their text.
    """

    name = "xgrammar"
    priority = 10  # what `auto` picks when no backend of higher priority is installed
    supported_kinds: ClassVar[frozenset[str]] = frozenset({"json", "regex", "choice", "grammar", "json_object"})
    grammar_syntax: ClassVar[str] = "GBNF (xgrammar's EBNF)"

    class Options(BaseModel):
        """``[plugins] structured_output_options`` understood by this backend (all optional)."""

        model_config = ConfigDict(extra="forbid")

        any_whitespace: bool = Field(
            True,
            description="JSON output (json, json_object) may have any whitespace between its elements; False: "
            "compact JSON, one space after ':' and ',' as Python's json.dumps writes it.",
        )
        max_threads: int = Field(
            8, ge=1, le=256,
            description="Threads xgrammar uses to compile one constraint, and to fill a step's rows of the bitmask "
            "(at most the machine's cores).",
        )  # fmt: skip
        cache_limit_bytes: int = Field(
            -1, ge=-1, description="Memory xgrammar's own compiled-grammar cache may hold; -1: no limit."
        )

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], **options: Any) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.options = self.Options(**validate_options("structured_output", type(self), options))
        self.xgr = importlib.import_module("xgrammar")
        # xgrammar works at the tokenizer's size, not the model's: it counts the ids past the tokenizer as special
        # tokens and checks every accepted token against that list, which would cost a checkpoint whose tokenizer
        # is far smaller than its embedding (a test model's) a scan of the whole vocabulary per token.
        self.tokenizer_size = min(vocab_size, max(tokenizer.get_vocab().values(), default=-1) + 1)
        stop = sorted(t for t in eos_token_ids if 0 <= t < self.tokenizer_size) or None  # None: the tokenizer's EOS
        self.tokenizer_info = self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.tokenizer_size, stop_token_ids=stop
        )
        threads = min(self.options.max_threads, os.cpu_count() or 1)  # xgrammar warns on stderr about more
        self.compiler = self.xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=threads, cache_enabled=True,
            cache_limit_bytes=self.options.cache_limit_bytes,
        )  # fmt: skip
        banned = special_token_ids(tokenizer) | set(self.tokenizer_info.special_token_ids)  # the latter: padding ids
        self.rules = TokenRules.build(self.tokenizer_info.stop_token_ids, banned, self.tokenizer_size)
        self._threaded = self.xgr.BatchGrammarMatcher(max_threads=threads)
        self._serial = self.xgr.BatchGrammarMatcher(max_threads=1)
        self._rows = self.xgr.allocate_token_bitmask(1, self.tokenizer_size)  # xgrammar's rows, before the rules

    def validate(self, kind: str, spec: str) -> None:
        """Parse the constraint into an xgrammar grammar (no tokenizer work); ``ValueError`` with xgrammar's
        reason, on one line, when it cannot."""
        grammar = self.xgr.Grammar
        if kind == "json":
            patched = self._patched_schema_ebnf(spec, self.options.any_whitespace)
            if patched is not None:
                self._call(grammar.from_ebnf, kind, patched)
        elif kind == "regex":
            self._call(grammar.from_regex, kind, spec)
        elif kind == "grammar":
            self._call(grammar.from_ebnf, kind, spec)
        elif kind == "choice":
            self._call(grammar.from_ebnf, kind, choice_ebnf(spec))
        elif kind != "json_object":
            raise ValueError(self._unsupported(kind))

    def compile(self, kind: str, spec: str, disable_any_whitespace: bool = False) -> Any:
        """An ``xgrammar.CompiledGrammar`` for this tokenizer. ``disable_any_whitespace``: JSON as xgrammar writes
        it without ``any_whitespace`` (one space after ``:`` and ``,``, as Python's ``json.dumps``; vLLM's
        meaning with xgrammar)."""
        compiler = self.compiler
        any_whitespace = self.options.any_whitespace and not disable_any_whitespace
        if kind == "json":
            patched = self._patched_schema_ebnf(spec, any_whitespace) if "Length" in spec else None  # min/maxLength
            if patched is not None:
                return self._call(compiler.compile_grammar, kind, patched)
            return self._call(compiler.compile_json_schema, kind, spec, any_whitespace=any_whitespace)
        if kind == "json_object":
            return self._call(compiler.compile_json_schema, kind, JSON_OBJECT_SCHEMA, any_whitespace=any_whitespace)
        if kind == "regex":
            return self._call(compiler.compile_regex, kind, spec)
        if kind == "grammar":
            return self._call(compiler.compile_grammar, kind, spec)
        if kind == "choice":
            return self._call(compiler.compile_grammar, kind, choice_ebnf(spec))
        raise ValueError(self._unsupported(kind))

    def new_grammar(self, compiled: Any) -> XgrammarGrammar:
        return XgrammarGrammar(self.xgr.GrammarMatcher(compiled), self)

    def fill_bitmasks(self, grammars: Sequence[XgrammarGrammar], bitmask: torch.Tensor) -> None:
        """Every row in one call of xgrammar's ``BatchGrammarMatcher`` (on its threads when the rows are work
        enough: :data:`PARALLEL_FILL_WORK`), then the :class:`TokenRules` over all rows at once. xgrammar writes
        rows of the tokenizer's width, contiguous, into a buffer of its own; they are copied into the engine's
        mask, which is as wide as the model's vocabulary, with the words past the tokenizer's left clear."""
        num_rows, rules = len(grammars), self.rules
        if self._rows.shape[0] < num_rows:
            self._rows = self.xgr.allocate_token_bitmask(max(num_rows, 2 * self._rows.shape[0]), self.tokenizer_size)
        rows = self._rows[:num_rows]
        matchers = [grammar.matcher for grammar in grammars]
        live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]
        if live:
            parallel = len(live) * self.tokenizer_size >= PARALLEL_FILL_WORK
            batch = self._threaded if parallel else self._serial
            batch.batch_fill_next_token_bitmask([matchers[i] for i in live], rows, live)
        words = rows.shape[1]
        torch.bitwise_and(rows, rules.keep_row, out=bitmask[:, :words])
        bitmask[:, words:] = 0
        complete = [i for i, matcher in enumerate(matchers) if matcher.is_completed()]  # terminated ones too
        if complete:
            bitmask[complete, :words] |= rules.stop_row
        if len(live) < num_rows:
            done = [i for i in range(num_rows) if matchers[i].is_terminated()]
            bitmask[done, :words] = rules.stop_row

    def _patched_schema_ebnf(self, spec: str, any_whitespace: bool) -> str | None:
        """Convert the schema (raising its error); the grammar's EBNF with :data:`LENGTH_BOUNDED_CHAR` replaced,
        or None when it has none (then ``compile_json_schema`` compiles the schema as it is)."""
        convert = self.xgr.Grammar.from_json_schema
        text = str(self._call(convert, "json", spec, any_whitespace=any_whitespace))
        return text.replace(LENGTH_BOUNDED_CHAR, JSON_STRING_CHAR) if LENGTH_BOUNDED_CHAR in text else None

    def _call(self, fn: Any, kind: str, spec: str, **kwargs: Any) -> Any:
        """``fn(spec, **kwargs)``, its xgrammar error as a one-line ``ValueError`` (xgrammar raises
        ``RuntimeError`` subclasses with a C++ log prefix and, for some, several lines)."""
        try:
            return fn(spec, **kwargs)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = one_line_reason(exc)
            if kind == "grammar" and "::=" not in spec:
                reason += '; grammars are GBNF (xgrammar\'s EBNF, e.g. root ::= "yes" | "no"), not Lark'
            raise ValueError(reason) from None

    def _unsupported(self, kind: str) -> str:
        return f"unknown constraint kind {kind!r}; xgrammar takes {', '.join(sorted(self.supported_kinds))}"
