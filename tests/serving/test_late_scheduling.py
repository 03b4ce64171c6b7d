"""``late_scheduling``: the step loop schedules the next step shortly before the running one ends, so that a
request arriving meanwhile joins the next step (its first token one step earlier).

The engine is the real :class:`EngineCore` with the fifo policy over a simulated device whose steps take
``STEP_S`` each, one after the other, as a GPU's queue runs them (a step starts when it was launched or when the
previous one ended, whichever is later); reading a step's tokens waits for its end.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core.engine import core
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.serving.step_loop import run_step_loop
from nanovllm_core.testing.simulated import SimulatedEngine

STEP_S = 0.1  # the simulated device time of every step: long against a loaded CI machine's jitter


class _TimedStep:
    """A simulated step that the device finishes at ``end``; ``tokens()`` waits for it as a GPU's would."""

    def __init__(self, inner, end: float) -> None:
        self._inner = inner
        self.end = end
        self.done_at: float | None = None
        self.waited = False

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def tokens(self) -> list[int | None]:
        if self.done_at is None:
            self.waited = time.monotonic() < self.end
            time.sleep(max(0.0, self.end - time.monotonic()))
            self.done_at = time.monotonic()
        return self._inner.tokens()


class _TimedDevice:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.last_end = 0.0

    def launch(self, batch, in_flight=None) -> _TimedStep:
        inner = self.runner.launch(batch, in_flight._inner if in_flight is not None else None)
        self.last_end = max(time.monotonic(), self.last_end) + STEP_S
        return _TimedStep(inner, self.last_end)


def first_token_delay(late: bool) -> float:
    """Seconds from a request's arrival, just after a step started, to its first token, with a request already
    decoding (so the device is busy and the loop has learned the step time). The margin before a step's
    expected end is 20 ms here, against a loaded machine's timer jitter."""
    sim = SimulatedEngine(FifoScheduler, PrefixCachingBlockManager, num_blocks=64, async_scheduling=True)
    sim.config.late_scheduling = late
    engine = sim.core
    engine.step_runner = _TimedDevice(sim.runner)
    commands: queue.Queue = queue.Queue()
    first_token: dict[str, float] = {}
    steps_seen = threading.Event()
    emitted = [0]

    def next_commands(timeout: float | None) -> list:
        try:
            batch = [commands.get(timeout=timeout) if timeout != 0 else commands.get_nowait()]
        except queue.Empty:
            return []
        while not commands.empty():
            batch.append(commands.get_nowait())
        return batch

    def emit(results, outputs, now, account) -> None:
        for out in outputs:
            first_token.setdefault(out.request_id, now)
        if outputs:
            emitted[0] += 1
            if emitted[0] == 6:
                steps_seen.set()

    params = SamplingParams(max_tokens=40, output_kind="delta", ignore_eos=True)
    commands.put((None, "add", (list(range(1, 9)), params, "decoding")))
    loop = threading.Thread(target=run_step_loop, args=(engine, next_commands, emit), daemon=True)
    loop.start()
    assert steps_seen.wait(10), "the loop did not step"
    time.sleep(0.01)  # just after a step's outputs were handed over: the next step is running on the device
    arrival = time.monotonic()
    commands.put((None, "add", (list(range(20, 28)), SamplingParams(max_tokens=2, output_kind="delta"), "new")))
    for _ in range(200):
        if "new" in first_token:
            break
        time.sleep(0.01)
    commands.put((None, "stop", ()))
    loop.join(10)
    assert not loop.is_alive()
    return first_token["new"] - arrival


@pytest.mark.parametrize("late", [False, True], ids=["at-once", "late"])
def test_a_request_arriving_during_a_step_joins_the_next_one(late: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "LATE_SCHEDULING_MARGIN_S", 0.02)
    delay = first_token_delay(late)
    if late:  # scheduled just before the running step ends: its first token comes with the next step
        assert delay < 2.5 * STEP_S, f"first token {delay:.3f} s after arrival"
    else:  # the next step was scheduled as the running one began: it comes with the step after that
        assert delay > 2.5 * STEP_S, f"first token {delay:.3f} s after arrival"


def test_the_deadline_needs_a_busy_device_and_two_step_times() -> None:
    """No deadline without timing (a CPU step), after an idle device, or before two step times are known;
    then: the end of the last step waited for, plus the shortest step time, less the host's time and margin."""
    sim = SimulatedEngine(FifoScheduler, PrefixCachingBlockManager, num_blocks=64, async_scheduling=True)
    engine = sim.core
    assert engine.next_step_deadline() is None
    engine._in_flight = object()
    steps = []
    for done_at, waited in ((1.0, True), (1.5, True), (2.1, True)):
        step = _TimedStep(None, done_at)
        step.done_at, step.waited = done_at, waited
        steps.append(step)
    engine._note_done(steps[0], 0.9)
    assert engine.next_step_deadline() is None  # no step time yet
    engine._note_done(steps[1], 1.45)
    assert engine.next_step_deadline() is None  # one
    engine._note_done(steps[2], 2.0)
    engine._host_seconds.extend([0.002, 0.004])
    assert engine.next_step_deadline() == pytest.approx(2.1 + 0.5 - 0.004 - core.LATE_SCHEDULING_MARGIN_S)
    idle = _TimedStep(None, 3.0)
    idle.done_at, idle.waited = 3.0, False  # done before the host looked: the device sat idle
    engine._note_done(idle, 3.5)
    assert engine.next_step_deadline() is None
