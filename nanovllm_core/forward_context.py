"""The per-step state that attention layers read: the backend and its metadata for this batch."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    backend: Any
    metadata: Any


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention layer called outside a model-runner step (no forward context is set)")
    return _context


@contextmanager
def forward_context(backend: Any, metadata: Any):
    global _context
    previous, _context = _context, ForwardContext(backend, metadata)
    try:
        yield
    finally:
        _context = previous
