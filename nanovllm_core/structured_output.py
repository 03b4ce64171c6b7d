"""The structured-output plugin kind: a grammar engine that keeps every output inside a constraint.

A backend (registered with ``nanovllm_register_structured_output_backends``, selected by
``[plugins] structured_output_backend``) is built once per engine for its tokenizer. For each distinct
constraint (:class:`~nanovllm_core.sampling_params.StructuredOutputsParams`: a kind and its text) the engine
calls :meth:`StructuredOutputBackend.compile` once, in a thread pool off the engine loop, and keeps the result;
every sequence that uses it gets a :class:`StructuredOutputGrammar` of its own from :meth:`~StructuredOutputBackend.
new_grammar`. Before each step that samples constrained sequences, the engine asks the backend for their bitmask
of allowed tokens, one row each (:meth:`StructuredOutputBackend.fill_bitmasks`, by default each grammar's
:meth:`~StructuredOutputGrammar.fill_bitmask`); the sampler then sets every other token's logit to ``-inf``.
After the token is read, :meth:`~StructuredOutputGrammar.accept_tokens` advances it.

The bitmask is vLLM's and xgrammar's layout: int32, ``[rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. :class:`nanovllm_testing.conformance.StructuredOutputConformance`
checks a backend against these contracts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class StructuredOutputGrammar(ABC):
    """One sequence's place in a compiled constraint (vLLM's name). Used by one thread at a time."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: Iterable[int]) -> bool:
        """Advance over ``tokens``; False (and no advance past the first rejected one) when one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write row ``index`` of ``bitmask`` (int32, CPU): the tokens allowed next. Once terminated, only the
        end-of-sequence tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and an end-of-sequence token was accepted."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a discarded step)."""

    def reset(self) -> None:  # noqa: B027 - optional: most grammars are made anew rather than reset
        """Back to the start of the constraint."""


class StructuredOutputBackend(ABC):
    """A grammar engine bound to one tokenizer.

    Built as ``cls(tokenizer, vocab_size, eos_token_ids, **structured_output_options)``: ``tokenizer`` is the
    engine's Hugging Face tokenizer, ``vocab_size`` the model's (its logits' width, which may exceed the
    tokenizer's: tokens it does not know are never allowed), ``eos_token_ids`` the tokens that end a sequence.

    ``supported_kinds``: the constraint kinds it compiles, of ``"json"``, ``"regex"``, ``"choice"``,
    ``"grammar"`` and ``"json_object"``; a request of another kind is refused when it is added, naming them.
    """

    priority: ClassVar[int] = 0  # `auto` picks the installed backend with the highest priority
    supported_kinds: ClassVar[frozenset[str]] = frozenset({"json", "regex", "choice", "grammar", "json_object"})
    grammar_syntax: ClassVar[str] = ""
    """What ``"grammar"`` specs are written in (shown in errors and ``docs/structured-output.md``)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @abstractmethod
    def validate(self, kind: str, spec: str) -> None:
        """Raise ``ValueError`` with a one-line reason if ``spec`` is not a valid constraint of ``kind``. Called
        for every request when it is added, on the caller's thread, so it should be cheap (no tokenizer-wide
        compilation)."""

    @abstractmethod
    def compile(self, kind: str, spec: str, disable_any_whitespace: bool = False) -> Any:
        """Compile a constraint for this tokenizer (may be slow; runs in a thread pool, possibly several at once).
        The result is shared by every sequence with the same constraint and never mutated. ``spec`` is
        :attr:`StructuredOutputsParams.spec`: a JSON schema as JSON text, choices as a JSON list of strings,
        ``""`` for ``json_object``. ``disable_any_whitespace`` (``json`` and ``json_object`` only): JSON without
        optional whitespace, in the backend's compact form, whatever the backend's own options say."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh grammar at the start of a compiled constraint (cheap: once per sequence)."""

    def fill_bitmasks(self, grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor) -> None:
        """Write row ``i`` of ``bitmask`` for ``grammars[i]``, as each one's :meth:`~StructuredOutputGrammar.
        fill_bitmask` would, for every constrained row of a step. The engine calls this once per step, while the
        device runs the step's forward: a backend overrides it to fill the rows in parallel or in one native call
        (the rows of a large batch are the host's largest share of a constrained step)."""
        for index, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, index)

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 CPU bitmask of ``num_rows`` rows, every token allowed."""
        return torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)

    def destroy(self) -> None:  # noqa: B027 - optional: release what the backend holds
        """Called when the engine shuts down."""
