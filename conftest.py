"""Settings for the whole suite (``tests/`` and every plugin's ``tests/``)."""

from __future__ import annotations

import os


def pytest_configure(config):
    # Workers of pytest-xdist share the machine's cores: each gets its share of torch threads, and so do the servers
    # and engine processes its tests start. Otherwise each worker's torch runs as many threads as there are cores,
    # and every small matmul of a hand-stepped engine waits for a thread the other worker has taken off the CPU.
    # An OMP_NUM_THREADS of the caller's is kept, as torch itself keeps it.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
