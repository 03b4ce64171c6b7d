"""The start-up heap out of the garbage collector's way, and the collector's pauses counted.

A process that has imported torch, transformers and the server stack tracks a few hundred thousand container
objects. Python's full (oldest-generation) collection walks all of them, each time enough long-lived objects have
piled up, and while serving every such pause stalls every stream at once.
:func:`freeze_startup_heap`, once start-up is over, moves everything alive then into the permanent generation
that collections skip (``gc.freeze``, as vLLM does in its API server and engine core); later objects are
collected as usual, but less often: the youngest generation is collected after ``YOUNG_THRESHOLD`` net
allocations instead of Python's 700, since a streaming front-end allocates a few objects per token and would
otherwise run many collections a second, some of them full ones that stall every stream. Only for processes
nanovllm owns (the server, its engine process, tensor-parallel workers): in a caller's own process a frozen
object that later becomes cyclic garbage would never be freed, and the collector's settings are the caller's.
"""

from __future__ import annotations

import atexit
import gc
import time
from dataclasses import dataclass, field

__all__ = ["GCPauses", "freeze_startup_heap"]

_unfreeze_registered = False
YOUNG_THRESHOLD = 10_000  # net allocations between collections of the youngest generation (Python's default: 700)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now, and collect the youngest generation less often (at least
    ``YOUNG_THRESHOLD`` allocations apart); returns how many objects are frozen. At exit they are unfrozen, so
    that the interpreter's final collection still frees them (extension modules report leaks otherwise)."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:  # 0: collection is off, which is the caller's to decide
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    return gc.get_freeze_count()


@dataclass
class GCPauses:
    """Counts the collections and the time spent in them, per generation, while installed (``with``)."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0
    _started: float = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += elapsed
        self.longest_s = max(self.longest_s, elapsed)

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        total = sum(self.seconds)
        return (
            f"{sum(self.collections)} collections ({self.collections[2]} full) took {total * 1e3:.0f} ms, "
            f"the longest {self.longest_s * 1e3:.0f} ms"
        )
