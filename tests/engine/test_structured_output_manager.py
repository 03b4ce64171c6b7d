"""The engine's structured-output manager with a backend of its own: what keys the compile cache, that a step's
rows go to the backend in one ``fill_bitmasks`` call, and that shutting down leaves no compile thread behind."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nanovllm_core.engine.structured_output import StructuredOutputManager
from nanovllm_core.sampling_params import StructuredOutputsParams
from nanovllm_core.structured_output import StructuredOutputBackend, StructuredOutputGrammar

VOCAB = 70


class OneTokenGrammar(StructuredOutputGrammar):
    """Allows exactly one token, the one its constraint names."""

    def __init__(self, token: int) -> None:
        self.token = token

    def accept_tokens(self, request_id: str, tokens: Iterable[int]) -> bool:
        return all(t == self.token for t in tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        bitmask[index, self.token // 32] = 1 << (self.token % 32)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass


class CountingBackend(StructuredOutputBackend):
    """Regexes of one digit, each the token of that id; counts what the engine asks of it."""

    supported_kinds = frozenset({"regex", "json"})

    def __init__(self) -> None:
        super().__init__(None, VOCAB, frozenset({0}))
        self.compiled: list[tuple[str, str, bool]] = []
        self.fills: list[int] = []

    def validate(self, kind: str, spec: str) -> None:
        pass

    def compile(self, kind: str, spec: str, disable_any_whitespace: bool = False) -> Any:
        self.compiled.append((kind, spec, disable_any_whitespace))
        return int(spec) if kind == "regex" else 1

    def new_grammar(self, compiled: Any) -> OneTokenGrammar:
        return OneTokenGrammar(compiled)

    def fill_bitmasks(self, grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor) -> None:
        self.fills.append(len(grammars))
        super().fill_bitmasks(grammars, bitmask)


class Seq:
    def __init__(self, grammar: StructuredOutputGrammar | None) -> None:
        self.grammar = grammar


def test_the_compile_cache_is_keyed_by_kind_text_and_whitespace() -> None:
    backend = CountingBackend()
    manager = StructuredOutputManager(backend)
    try:
        schema = {"type": "object"}
        for params in (
            StructuredOutputsParams(json=schema),
            StructuredOutputsParams(json=schema),  # the same: cached
            StructuredOutputsParams(json=schema, disable_any_whitespace=True),  # compact: compiled apart
            StructuredOutputsParams(regex="7"),
            StructuredOutputsParams(regex="7", disable_any_whitespace=True),  # no JSON: the flag changes nothing
        ):
            manager.compile(params).result(timeout=10)
        assert backend.compiled == [("json", '{"type": "object"}', False), ("json", '{"type": "object"}', True),
                                    ("regex", "7", False)]  # fmt: skip
    finally:
        manager.shutdown()


def test_a_step_s_rows_go_to_the_backend_in_one_call() -> None:
    backend = CountingBackend()
    manager = StructuredOutputManager(backend)
    try:
        seqs = [Seq(None)] + [Seq(manager.new_grammar(manager.compile(StructuredOutputsParams(regex=str(d)))
                                                      .result(timeout=10))) for d in (3, 5, 9)]  # fmt: skip
        bitmask = manager.bitmask(seqs, [1, 3])
        assert backend.fills == [2]
        assert bitmask.shape == (2, (VOCAB + 31) // 32)
        assert bitmask[0].tolist() == [1 << 3, 0, 0] and bitmask[1].tolist() == [1 << 9, 0, 0]
        bitmask = manager.bitmask(seqs, [1, 2, 3])  # more rows than before: a larger buffer
        assert backend.fills == [2, 3] and bitmask[1].tolist() == [1 << 5, 0, 0]
    finally:
        manager.shutdown()


def test_shutdown_leaves_no_compile_thread() -> None:
    before = set(threading.enumerate())
    manager = StructuredOutputManager(CountingBackend())
    for d in range(6):
        manager.compile(StructuredOutputsParams(regex=str(d))).result(timeout=10)
    assert any(t.name.startswith("nanovllm-grammar") for t in threading.enumerate())
    manager.shutdown()
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=10)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads left after shutdown: {left}"
