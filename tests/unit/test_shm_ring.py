"""The shared-memory broadcast ring that carries tensor-parallel step inputs, and the Ctrl-C hold."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time

import pytest

from nanovllm_core.engine.shm_ring import REPORT_BYTES, BroadcastRing, RingLayout
from nanovllm_core.engine.sigint_hold import SigintHold


@pytest.fixture
def ring():
    writer = BroadcastRing.create(num_readers=2, num_slots=3, slot_bytes=64)
    yield writer
    writer.close(unlink=True)


def read_all(layout: RingLayout, reader: int, count: int, out: list) -> None:
    ring = BroadcastRing.attach(layout, reader)
    try:
        for _ in range(count):
            out.append(ring.recv(timeout=20))
    finally:
        ring.close()


def test_every_reader_gets_every_message_in_order(ring):
    rng = random.Random(0)
    # empty, smaller than a slot, exactly a slot, several slots, longer than the whole ring
    messages = [b"", b"x", bytes(64), bytes(range(200)), rng.randbytes(1000)]
    messages += [rng.randbytes(rng.randrange(0, 300)) for _ in range(200)]
    received: list[list] = [[], []]
    threads = [threading.Thread(target=read_all, args=(ring.layout, r, len(messages), received[r])) for r in range(2)]
    for t in threads:
        t.start()
    for message in messages:
        assert ring.send(message, timeout=20)
    for t in threads:
        t.join(30)
    assert received[0] == messages
    assert received[1] == messages


def test_a_sleeping_reader_wakes_on_its_doorbell_at_once():
    writer = BroadcastRing.create(num_readers=1, num_slots=2, slot_bytes=64)
    reader = BroadcastRing.attach(writer.layout, 0, doorbell=writer.make_doorbells()[0])
    reader.spin_s = 0.0  # straight to sleep: each message must ring the bell (a nap lasts 50 ms otherwise)
    latencies: list[float] = []

    def read() -> None:
        for _ in range(10):
            sent = float(reader.recv(timeout=10))
            latencies.append(time.perf_counter() - sent)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for _ in range(10):
            time.sleep(0.03)  # the reader is asleep by now
            assert writer.send(repr(time.perf_counter()).encode())
        thread.join(10)
        assert len(latencies) == 10
        assert sorted(latencies)[5] < 0.01, latencies
    finally:
        reader.close()
        writer.close(unlink=True)


def test_writer_waits_for_the_slowest_reader_and_gives_up_at_its_deadline(ring):
    fast = BroadcastRing.attach(ring.layout, 0)
    try:
        for i in range(3):  # fills the three slots; reader 1 reads nothing
            assert ring.send(bytes([i]))
            assert fast.recv(timeout=1) == bytes([i])
        start = time.monotonic()
        assert not ring.send(b"late", timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 2
    finally:
        fast.close()


def test_recv_times_out_and_check_can_give_up(ring):
    reader = BroadcastRing.attach(ring.layout, 1)
    try:
        assert reader.recv(timeout=0.1) is None

        def gone() -> None:
            raise ConnectionError("writer gone")

        reader.spin_s = 0.0
        with pytest.raises(ConnectionError, match="writer gone"):
            reader.recv(check=gone, timeout=5)
    finally:
        reader.close()


def test_reports_travel_from_reader_to_writer(ring):
    reader = BroadcastRing.attach(ring.layout, 1)
    try:
        assert ring.state(1) == 0 and ring.report_text(1) == ""
        reader.report(1, 2, "RuntimeError: out of memory")
        assert ring.state(1) == 2
        assert ring.report_text(1) == "RuntimeError: out of memory"
        reader.report(1, 2, "é" * REPORT_BYTES)  # cut to the area, never past it
        assert len(ring.report_text(1).encode()) <= REPORT_BYTES
        assert ring.state(0) == 0  # the other reader's area is untouched
    finally:
        reader.close()


def test_layout_round_trips_and_bad_arguments_are_clear(ring):
    assert RingLayout.decode(ring.layout.encode()) == ring.layout
    with pytest.raises(ValueError, match="reader 2 does not exist in a ring of 2 readers"):
        BroadcastRing.attach(ring.layout, 2)
    with pytest.raises(ValueError, match="at least one reader"):
        BroadcastRing.create(num_readers=0)


def held_function(hold: SigintHold, events: list) -> None:
    hold.hold(sys._getframe())
    signal.raise_signal(signal.SIGINT)  # arrives while this function runs: kept pending
    time.sleep(0.05)  # the retries find it still running
    events.append("finished")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_ctrl_c_is_held_until_the_held_function_returns():
    hold = SigintHold()
    hold.install()
    events: list = []
    try:
        with pytest.raises(KeyboardInterrupt):
            held_function(hold, events)
            assert hold.pending
            time.sleep(1)  # delivered by the next retry, here
            events.append("not interrupted")
        assert events == ["finished"]
        # delivered at once at a safe point when one comes first
        with pytest.raises(KeyboardInterrupt):
            hold.hold(sys._getframe())
            signal.raise_signal(signal.SIGINT)
            assert hold.pending
            hold.deliver_pending(sys._getframe())
        # nothing held: an ordinary Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            time.sleep(1)
    finally:
        hold.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_ctrl_c_is_held_when_no_retry_thread_can_start(monkeypatch):
    """At interpreter exit (a shutdown run by a finalizer) no thread starts: the hold still works, and the
    interrupt is delivered at the next safe point."""

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    hold = SigintHold()
    hold.install()
    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        hold.hold(sys._getframe())
        signal.raise_signal(signal.SIGINT)
        assert hold.pending
        with pytest.raises(KeyboardInterrupt):
            hold.deliver_pending(sys._getframe())
    finally:
        hold.uninstall()
