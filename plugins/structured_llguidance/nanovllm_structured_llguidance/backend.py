"""``guidance``: the structured-output backend on llguidance (vLLM's name for it).

llguidance compiles a constraint into a lazily built lexer and an Earley parser, and computes each step's mask from
the parser's state by walking the tokenizer's token trie: nothing is precomputed per grammar state, so compiling
costs little and each mask is computed when it is asked for.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from pydantic import BaseModel, ConfigDict, Field

from nanovllm_core import StructuredOutputBackend, StructuredOutputGrammar, bitmask_words
from nanovllm_core.errors import ConfigError
from nanovllm_structured_llguidance.specs import grammar_text, one_line

logger = logging.getLogger(__name__)

# llguidance prints its warnings to stderr itself at log level 1; every error it has is read back with
# get_error() and raised or logged here, so its matchers stay silent.
_SILENT = 0


@dataclass(frozen=True)
class CompiledGuidance:
    """A compiled constraint: llguidance's grammar text and a matcher built from it that is never advanced.

    Each sequence's grammar is a ``deep_copy`` of ``matcher``, which shares the compiled lexer and parser
    tables, so a new sequence costs a copy of the parser state rather than a compilation.
    """

    kind: str
    grammar: str
    matcher: LLMatcher


class GuidanceBackend(StructuredOutputBackend):
    """JSON schemas, regexes, choices, Lark grammars (GBNF is converted) and any JSON object, on llguidance.

    The llguidance tokenizer covers the Hugging Face tokenizer's own tokens; ids from there up to the model's
    ``vocab_size`` (padding rows of the embedding) exist only in the bitmask, where they are always cleared.
    """

    name = "guidance"  # as the engine's messages name it (the plugin registers it under this name)
    priority = 5  # below xgrammar's 10: `auto` picks xgrammar when both are installed, as vLLM does
    supported_kinds = frozenset({"json", "regex", "choice", "grammar", "json_object"})
    grammar_syntax = "Lark (llguidance)"

    class Options(BaseModel):
        """``[plugins] structured_output_options`` accepted by ``guidance``."""

        model_config = ConfigDict(extra="forbid")
        whitespace_flexible: bool = Field(
            True,
            description="JSON may hold any whitespace between its tokens (llguidance's and vLLM's default); "
            "false allows none, so the output is compact JSON. A schema's own `x-guidance` settings win.",
        )
        disable_additional_properties: bool = Field(
            False,
            description="An object schema with `properties` and no `additionalProperties` gets "
            "`additionalProperties: false` (vLLM's `disable-additional-properties`): only the keys it names.",
        )

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        whitespace_flexible: bool = True,
        disable_additional_properties: bool = False,
    ) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.json_options = {"whitespace_flexible": whitespace_flexible}
        self.disable_additional_properties = disable_additional_properties
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self._executor = LLExecutor()  # llguidance's threads for a step's rows
        # imported here, not with the plugin: `llguidance.torch` decorates a function with torch.compile at import,
        # which loads torch's compiler (seconds), and every `nanovllm` command loads the plugins
        import llguidance.torch  # noqa: F401 - used as llguidance.torch below
        self._rows = torch.empty((0, bitmask_words(self.ll_tokenizer.vocab_size)), dtype=torch.int32)

    def validate(self, kind: str, spec: str) -> None:
        """Build the grammar and check it without the tokenizer: llguidance then reads the grammar (schema
        keywords, regex syntax, Lark rules) but builds nothing over the vocabulary. A grammar naming a special
        token the tokenizer lacks passes here and fails in :meth:`compile`."""
        grammar = self._grammar(kind, spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(one_line(messages[0], keep_position=kind == "grammar"))

    def compile(self, kind: str, spec: str, disable_any_whitespace: bool = False) -> CompiledGuidance:
        """The constraint's matcher for this tokenizer. Thread-safe: the llguidance tokenizer is immutable and
        llguidance builds the matcher without the GIL, so several compile at once. ``disable_any_whitespace``:
        JSON without flexible whitespace (``whitespace_flexible`` off, as vLLM passes it to llguidance)."""
        grammar = self._grammar(kind, spec, compact=disable_any_whitespace)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=_SILENT)
        if matcher.is_error():
            raise ValueError(one_line(matcher.get_error(), keep_position=kind == "grammar"))
        return CompiledGuidance(kind, grammar, matcher)

    def new_grammar(self, compiled: CompiledGuidance) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.matcher.deep_copy(), self.eos_token_ids, self.ll_tokenizer.vocab_size)

    def fill_bitmasks(self, grammars: Sequence[GuidanceGrammar], bitmask: torch.Tensor) -> None:
        """Every row in one call of llguidance's executor, which computes them on its own threads. llguidance
        writes rows of the tokenizer's width, contiguous, into a buffer of its own; they are copied into the
        engine's mask, with the model's padding ids past them cleared."""
        num_rows = len(grammars)
        if self._rows.shape[0] < num_rows:
            self._rows = torch.empty((max(num_rows, 2 * self._rows.shape[0]), self._rows.shape[1]), dtype=torch.int32)
        rows = self._rows[:num_rows]
        matchers = [(g._matcher, i) for i, g in enumerate(grammars)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, matchers, rows)
        words = rows.shape[1]
        bitmask[:, :words] = rows
        bitmask[:, words:] = 0

    def _grammar(self, kind: str, spec: str, compact: bool = False) -> str:
        options = {**self.json_options, "whitespace_flexible": False} if compact else self.json_options
        try:
            return grammar_text(kind, spec, options, self.disable_additional_properties)
        except ValueError as exc:  # UnicodeEncodeError (a lone surrogate on its way to llguidance) included
            raise ValueError(one_line(str(exc), keep_position=kind == "grammar")) from None


class GuidanceGrammar(StructuredOutputGrammar):
    """One sequence's llguidance matcher, and where in it the sequence ended.

    Once the constraint is complete and can take nothing more (a choice spelled out, a closed JSON value), the
    matcher stops before any end-of-sequence token: its mask allows only those, but it records none of them
    (``try_consume_tokens`` refuses them, and ``consume_token`` says yes without recording, so a later
    rollback would undo the token before). Those are counted here instead, as a tail of accepted tokens the
    matcher does not hold, so that :meth:`accept_tokens` takes what :meth:`fill_bitmask` allows and
    :meth:`rollback` undoes exactly the tokens accepted last.
    """

    def __init__(self, matcher: LLMatcher, eos_token_ids: frozenset[int], tokenizer_size: int) -> None:
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self._tokenizer_size = tokenizer_size
        self._tokenizer_words = bitmask_words(tokenizer_size)
        self._num_accepted = 0
        self._num_unrecorded = 0  # the last accepted tokens, all end-of-sequence, that the matcher does not hold
        self._end: int | None = None  # index of the end-of-sequence token that completed the constraint

    def accept_tokens(self, request_id: str, tokens: Iterable[int]) -> bool:
        for token in tokens:
            if token in self._eos_token_ids and (self._end is not None or self._complete()):
                self._num_unrecorded += 1
            elif self._end is not None or not self._consume(token):
                if self._matcher.is_error():  # a limit hit or an internal error, not a refused token
                    logger.warning("request %s: llguidance: %s", request_id, _first_line(self._matcher.get_error()))
                return False
            if self._end is None and token in self._eos_token_ids:
                self._end = self._num_accepted
            self._num_accepted += 1
        return True

    def _complete(self) -> bool:
        """Whether the matcher has stopped because the constraint can take nothing more (not on an error)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def _consume(self, token: int) -> bool:
        """Advance the matcher over one token if the grammar allows it. ``try_consume_tokens`` refuses a token
        without entering the error state that ``consume_token`` would, so a refused token leaves the matcher as
        it was; it takes an end-of-sequence token while the constraint may still go on (the matcher then
        records it and stops)."""
        return 0 <= token < self._tokenizer_size and self._matcher.try_consume_tokens([token]) == 1

    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        words = self._tokenizer_words
        if words == bitmask.shape[1]:
            llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, index)
            return
        # llguidance writes the tokenizer's words; the model's padding ids beyond them are never allowed
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask[:, :words], index)
        bitmask[index, words:] = 0

    def is_terminated(self) -> bool:
        return self._end is not None

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} were accepted")
        unrecorded = min(num_tokens, self._num_unrecorded)
        recorded = num_tokens - unrecorded
        if recorded and not self._matcher.rollback(recorded):
            raise RuntimeError(f"llguidance could not roll back: {_first_line(self._matcher.get_error())}")
        self._num_unrecorded -= unrecorded
        self._num_accepted -= num_tokens
        if self._end is not None and self._end >= self._num_accepted:
            self._end = None

    def reset(self) -> None:
        self._matcher.reset()
        self._num_accepted, self._num_unrecorded, self._end = 0, 0, None


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> LLTokenizer:
    """llguidance's tokenizer for a fast Hugging Face tokenizer, its own size, ending on ``eos_token_ids``."""
    import llguidance.hf  # here: it imports transformers

    eos = sorted(eos_token_ids)
    try:  # one id as an int: llguidance releases before multi-EOS support take no list
        ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=(eos[0] if len(eos) == 1 else eos) or None)
    except ValueError as exc:
        raise ConfigError(f"the guidance structured-output backend cannot read the tokenizer: {exc}") from None
    except TypeError:
        version = importlib.metadata.version("llguidance")
        raise ConfigError(
            f"the model has {len(eos)} end-of-sequence ids and llguidance {version} takes one; upgrade llguidance"
        ) from None
    if ll_tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {ll_tokenizer.vocab_size} tokens but the model's vocabulary only {vocab_size}; "
            "the guidance structured-output backend needs every token to have a logit"
        )
    return ll_tokenizer


def _first_line(message: str) -> str:
    return message.strip().split("\n", 1)[0]
