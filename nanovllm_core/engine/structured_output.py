"""The engine's side of structured output: which backend runs, constraints compiled once and off the loop, and
each step's bitmask of allowed tokens for the sequences that sample.

Compilation runs in a small thread pool; a request whose constraint is still compiling waits outside the
scheduler (the others run meanwhile) and joins it once its grammar is ready. Compiled constraints are kept by
their text (kind, spec and whitespace), so every request with the same schema after the first starts at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import ConfigError, InvalidRequestError
from nanovllm_core.plugins import PluginRegistry, none_installed_hint
from nanovllm_core.sampling_params import StructuredOutputsParams
from nanovllm_core.sequence import Sequence
from nanovllm_core.structured_output import StructuredOutputBackend, StructuredOutputGrammar

logger = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 1024  # distinct constraints kept compiled; the oldest unused one goes first


def select_structured_output_backend(registry: PluginRegistry, name: str) -> type[StructuredOutputBackend] | None:
    """The backend class ``[plugins] structured_output_backend`` names; for ``auto`` the installed one of highest
    priority, or None when none is installed (constrained requests are then refused, naming what to install)."""
    if name != "auto":
        return registry.get("structured_output", name).obj
    candidates = sorted(
        registry.registrations["structured_output"].values(), key=lambda r: -getattr(r.obj, "priority", 0)
    )
    return candidates[0].obj if candidates else None


class StructuredOutputManager:
    """Validates, compiles and caches constraints for one engine's backend, and fills the step's bitmask."""

    def __init__(self, backend: StructuredOutputBackend) -> None:
        self.backend = backend
        self.name = getattr(type(backend), "name", type(backend).__name__)
        workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="nanovllm-grammar")
        self._compiled: OrderedDict[tuple[str, str, bool], concurrent.futures.Future] = OrderedDict()
        self._bitmask = self._allocate(1)

    @classmethod
    def build(
        cls, backend_cls: type[StructuredOutputBackend] | None, options: dict[str, Any], tokenizer: Any,
        vocab_size: int, eos_token_ids: frozenset[int],
    ) -> StructuredOutputManager | None:
        """The manager of a backend class (None: no backend, and no manager), built for this tokenizer."""
        if backend_cls is None:
            return None
        if tokenizer is None:
            raise ConfigError("structured output needs the model's tokenizer; this engine has none")
        backend = instantiate(
            "structured_output", backend_cls, options, tokenizer=tokenizer, vocab_size=vocab_size,
            eos_token_ids=frozenset(eos_token_ids),
        )  # fmt: skip
        return cls(backend)

    def validate(self, params: StructuredOutputsParams) -> None:
        """InvalidRequestError naming the field and the reason when the backend cannot take this constraint."""
        kind = params.kind
        supported = type(self.backend).supported_kinds
        if kind not in supported:
            raise InvalidRequestError(
                f"structured_outputs.{kind} is not supported by the {self.name!r} backend; it supports "
                f"{', '.join(sorted(supported))}"
            )
        if self._key(params) in self._compiled:
            return
        try:
            self.backend.validate(kind, params.spec)
        except ValueError as exc:
            reason = " ".join(str(exc).split())
            raise InvalidRequestError(f"structured_outputs.{kind} is invalid ({self.name}): {reason}") from None

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled constraint, as a future: the cached one, or a compilation queued in the thread pool."""
        key = self._key(params)
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._pool.submit(self.backend.compile, *key)
        self._compiled[key] = future
        while len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    @staticmethod
    def _key(params: StructuredOutputsParams) -> tuple[str, str, bool]:
        """What makes two constraints compile alike: the backend's ``compile`` arguments."""
        compact = params.disable_any_whitespace and params.kind in ("json", "json_object")
        return params.kind, params.spec, compact

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return self.backend.new_grammar(compiled)

    def bitmask(self, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """An int32 bitmask with one row per entry of ``rows`` (indices into ``seqs``, each with a grammar)."""
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = self._allocate(max(len(rows), 2 * self._bitmask.shape[0]))
        bitmask = self._bitmask[: len(rows)]
        self.backend.fill_bitmasks([seqs[row].grammar for row in rows], bitmask)
        return bitmask

    def _allocate(self, num_rows: int) -> torch.Tensor:
        # Page-locked where a GPU may take it: copied from pageable memory, the mask would wait for the step's
        # forward ahead of it on the stream and hold the host meanwhile. Reusing one buffer is safe because the
        # engine reads a step's tokens (queued after its mask's copy) before it fills the next step's mask.
        # A normal tensor even when the runner asks from inside inference mode (filled in and out of it).
        with torch.inference_mode(False):
            bitmask = self.backend.allocate_token_bitmask(num_rows)
            return bitmask.pin_memory() if torch.cuda.is_available() else bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.destroy()


def no_backend_error() -> InvalidRequestError:
    return InvalidRequestError(
        "structured_outputs needs a structured-output backend and none is installed; "
        + none_installed_hint("structured_output")
    )
