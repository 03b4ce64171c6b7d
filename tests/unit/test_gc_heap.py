"""gc_heap: the start-up heap frozen out of full collections (in a process of its own), pauses counted."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from nanovllm_core.gc_heap import GCPauses

SCRIPT = textwrap.dedent(
    """
    import gc, time, weakref
    import torch  # a start-up heap of some size
    from nanovllm_core.gc_heap import freeze_startup_heap

    full = time.perf_counter(); gc.collect(); full = time.perf_counter() - full
    frozen = freeze_startup_heap()
    after = time.perf_counter(); gc.collect(); after = time.perf_counter() - after
    assert frozen > 10_000 and gc.get_freeze_count() == frozen, frozen
    assert gc.get_threshold()[0] == 10_000  # the youngest generation collected less often

    class Node:
        pass

    a, b = Node(), Node()  # garbage made after the freeze is still collected (also without an explicit collect)
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    kept = [[] for _ in range(12_000)]  # net allocations past the young threshold: a collection frees the cycle
    assert gone() is None and len(kept) == 12_000
    print(f"{frozen} {full * 1e3:.1f} {after * 1e3:.1f}")
    """
)


def test_frozen_heap_leaves_full_collections_short_and_later_garbage_collected():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr  # unfrozen at exit: extension modules see their objects freed
    frozen, full_ms, after_ms = done.stdout.split()
    assert float(after_ms) < float(full_ms) / 5, (full_ms, after_ms)


def test_pauses_are_counted_per_generation():
    with GCPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses.collections[0] >= 1 and pauses.collections[2] >= 1
    assert sum(pauses.seconds) > 0 and pauses.longest_s > 0
    assert "full" in pauses.summary()
    assert pauses._callback not in gc.callbacks
