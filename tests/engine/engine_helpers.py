"""Shared by the engine tests: prompts and sampling of the tests that compare runs (parity and async scheduling),
and the checks of the lifecycle tests (processes gone, a script that exits cleanly)."""

from __future__ import annotations

import random
import time
from typing import Any

from nanovllm_core import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def make_prompts(seed: int, lengths: list[int], vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


PROMPTS = make_prompts(0, [5, 17, 40, 73, 120])


SHUTDOWN_LIMIT_S = 5.0  # the bound on shutdown, and on exiting without one


def timed_shutdown(llm: Any) -> float:
    """``llm.shutdown()``; the seconds it took (the lifecycle tests check them against SHUTDOWN_LIMIT_S)."""
    start = time.monotonic()
    llm.shutdown()
    return time.monotonic() - start


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def assert_exited_cleanly(proc, exited: float) -> None:
    """A script that printed ``PIDS <its children>`` and ``END <time.time()>`` exited 0, within the shutdown bound
    after END, without a traceback, and left none of those processes running."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line[:3] in ("PID", "END"))
    assert exited - float(lines["END"]) < SHUTDOWN_LIMIT_S
    assert not [pid for pid in map(int, lines["PIDS"].split()) if pid_running(pid)]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
