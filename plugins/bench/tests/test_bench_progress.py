"""``nanovllm bench``'s progress bars: one per long phase on a terminal (elapsed time, tokens done where the engine
counts them), none in a log or with --no-progress."""

from __future__ import annotations

import io
import re
import sys
import threading
import time

import pytest
from nanovllm_bench.offline import Phase

from nanovllm_core.cli import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_phase_counts_from_a_thread_and_ends_full():
    out = Terminal()
    done = [0]
    with Phase("counting", 100, lambda: done[0], enabled=True, file=out, interval=0.01):
        for _ in range(5):
            done[0] += 10
            time.sleep(0.05)
    text = out.getvalue()
    assert re.search(r"counting:\s+[1-5]0%", text)  # read by the thread while the phase ran
    assert "counting: 100%" in text and "100/100" in text  # done: shown full
    assert not [t for t in threading.enumerate() if t.name == "bench-progress"]


def test_phase_without_a_count_shows_the_elapsed_time_and_stays_quiet_off_a_terminal():
    out = Terminal()
    with Phase("starting", enabled=True, file=out, interval=0.01):
        time.sleep(0.05)
    assert "starting: 00:00" in out.getvalue()
    log = io.StringIO()  # not a terminal: nothing by default
    with Phase("starting", 10, lambda: 5, file=log, interval=0.01):
        time.sleep(0.03)
    assert log.getvalue() == ""


def test_a_failing_phase_is_not_shown_as_done():
    out = Terminal()
    with pytest.raises(RuntimeError), Phase("run", 100, lambda: 30, enabled=True, file=out, interval=0.01):
        time.sleep(0.03)
        raise RuntimeError("stop")
    assert "100/100" not in out.getvalue() and "30/100" in out.getvalue()


BENCH = ["bench", "--shape", "tiny", "--device", "cpu", "--num-seqs", "2", "--max-input-len", "100"]
BENCH += ["--max-output-len", "100", "--warmup-prompts", "2", "--runs", "2", "--max-model-len", "512"]


def test_bench_shows_each_phase_on_a_terminal(monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(BENCH) == 0
    text = terminal.getvalue()
    for phase in ("measuring the cpu device's copy and GEMM rates: ", "starting the engine", "warm-up: 2 prompts: "):
        assert phase in text
    assert "run 1 of 2: 2 sequences: 100%" in text and "run 2 of 2: 2 sequences: 100%" in text
    assert "Throughput" in capsys.readouterr().out
    terminal.truncate(0)
    assert main([*BENCH, "--no-progress"]) == 0
    assert "run 1 of 2" not in terminal.getvalue() and "starting the engine" not in terminal.getvalue()
