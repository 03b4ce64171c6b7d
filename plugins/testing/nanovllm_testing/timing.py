"""GPU timing for the kernel tests and benchmarks: the median of CUDA-event timed calls."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_median_ms(
    fn: Callable[[], object], reps: int, warmup: int = 1, before: Callable[[], object] | None = None
) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls, each timed by its own CUDA events, after ``warmup``
    untimed calls; ``before`` runs ahead of each timed call, outside its timing (an L2-cache flush, say)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
