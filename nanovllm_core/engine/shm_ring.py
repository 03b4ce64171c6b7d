"""A broadcast ring in shared memory: one writer (rank 0) sends byte messages to N readers on the same host.

Each step's inputs go from rank 0 to the tensor-parallel workers through it, without a socket round trip.
A message is cut into chunks of at most ``slot_bytes``; chunk ``i`` goes to slot ``i % num_slots``. A slot's
``seq`` word is set to ``i + 1`` only after its data is in place, and the writer reuses a slot only once every
reader's ``read`` counter shows it has copied the chunk out: a sequence counter per slot, one writer, so no
lock is needed.

A waiting reader spins (yielding the CPU) for ``spin_s``, since steps follow each other within milliseconds;
then it raises its ``sleeping`` flag and blocks on its doorbell, a pipe the writer writes one byte to after
publishing a chunk, only for readers whose flag is up. Flag and ``seq`` are each written before the other is
read, with a memory barrier between, so a reader never sleeps through a message.

Each reader also has a report area (a state word and a short text) for telling the writer how it is doing:
started, failed and why.

Layout: little-endian uint64 words, per reader ``read``, ``state``, ``text length``, ``sleeping``, then per
slot ``seq``, ``length``, ``last``, then the writer's ``closing`` flag; byte regions follow (one report text
per reader, then the slots' data).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

REPORT_BYTES = 4096
_READER_WORDS = 4  # read, state, text length, sleeping
_SLOT_WORDS = 3  # seq, length, last
_READ, _STATE, _TEXT, _SLEEPING = range(_READER_WORDS)
_NAP_S = 0.05  # longest block on the doorbell before ``check`` runs again
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (taking a lock is a locked instruction): data before the word that publishes it,
    and a flag before the word that is read after it."""
    with _FENCE:
        pass


def wait_until(
    ready: Callable[[], bool],
    *,
    spin_s: float,
    check: Callable[[], None] | None = None,
    timeout: float | None = None,
    nap: Callable[[float], None] | None = None,
) -> bool:
    """Poll ``ready`` until it is true: yield the CPU for ``spin_s``, then ``nap`` (default: sleep, 20 us
    growing to 1 ms). ``check`` runs every 50 ms while waiting (it raises to give up, e.g. when the peer died).
    Returns False if ``timeout`` seconds passed first."""
    if ready():
        return True
    start = last_check = time.perf_counter()
    pause = 20e-6
    while True:
        now = time.perf_counter()
        if now - start < spin_s:
            os.sched_yield()
        elif nap is not None:
            nap(_NAP_S if timeout is None else min(_NAP_S, max(0.0, start + timeout - now)))
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if ready():
            return True
        if check is not None and now - last_check > 0.05:
            last_check = now
            check()
        if timeout is not None and now - start > timeout:
            return False


@dataclass(frozen=True)
class RingLayout:
    """What a reader needs to open a ring; ``encode()`` gives one line of text (for an environment variable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int

    def encode(self) -> str:
        return f"{self.name},{self.num_readers},{self.num_slots},{self.slot_bytes}"

    @classmethod
    def decode(cls, text: str) -> RingLayout:
        name, *numbers = text.split(",")
        return cls(name, *map(int, numbers))


class BroadcastRing:
    """Create with :meth:`create` (the writer), open with :meth:`attach` in each reader by its layout.

    ``doorbells`` (writer: one per reader, from :meth:`make_doorbells`) and ``doorbell`` (reader: the other
    end of its own) are optional; without them a waiting reader polls with short sleeps.
    """

    def __init__(
        self, shm: shared_memory.SharedMemory, num_readers: int, num_slots: int, slot_bytes: int, reader: int | None
    ) -> None:
        self.shm = shm
        self.name = shm.name
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.reader = reader  # None for the writer
        num_words = num_readers * _READER_WORDS + num_slots * _SLOT_WORDS + 1  # + the writer's 'closing' word
        self._closing_word = num_words - 1
        self._words = shm.buf[: num_words * 8].cast("Q")
        self._bytes = shm.buf[num_words * 8 :]
        self._data_off = num_readers * REPORT_BYTES
        self._count = 0  # chunks written (writer) or read (this reader)
        self.spin_s = 0.05
        self.doorbells: list[Connection] | None = None  # writer: the write end for each reader
        self.doorbell: Connection | None = None  # reader: its read end

    # --- layout -----------------------------------------------------------------------------------------

    def _reader_word(self, reader: int, field: int) -> int:
        return reader * _READER_WORDS + field

    def _slot_word(self, slot: int, field: int) -> int:
        return self.num_readers * _READER_WORDS + slot * _SLOT_WORDS + field

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 4, slot_bytes: int = 1 << 20) -> BroadcastRing:
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                "a ring needs at least one reader, one slot and one byte per slot "
                f"(got {num_readers} readers, {num_slots} slots, {slot_bytes} bytes)"
            )
        num_words = num_readers * _READER_WORDS + num_slots * _SLOT_WORDS + 1  # as __init__ lays them out
        size = num_words * 8 + num_readers * REPORT_BYTES + num_slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)  # the counters must start at zero
        return cls(shm, num_readers, num_slots, slot_bytes, None)

    @classmethod
    def attach(cls, layout: RingLayout, reader: int, doorbell: Connection | None = None) -> BroadcastRing:
        if not 0 <= reader < layout.num_readers:
            raise ValueError(f"reader {reader} does not exist in a ring of {layout.num_readers} readers")
        # The writer owns and unlinks the segment. Attaching registers it again with the resource tracker, which a
        # spawned reader shares with the writer: a no-op there, so it is left registered.
        shm = shared_memory.SharedMemory(name=layout.name)
        ring = cls(shm, layout.num_readers, layout.num_slots, layout.slot_bytes, reader)
        ring.doorbell = doorbell
        return ring

    @property
    def layout(self) -> RingLayout:
        return RingLayout(self.name, self.num_readers, self.num_slots, self.slot_bytes)

    def make_doorbells(self) -> list[Connection]:
        """Create one doorbell per reader; returns the read ends, to hand to the readers (they pickle to a
        spawned process)."""
        from multiprocessing import Pipe

        pairs = [Pipe(duplex=False) for _ in range(self.num_readers)]
        self.doorbells = [w for _, w in pairs]
        for w in self.doorbells:
            os.set_blocking(w.fileno(), False)  # a full pipe already holds a wake-up
        return [r for r, _ in pairs]

    # --- messages ---------------------------------------------------------------------------------------

    def send(self, data: bytes, check: Callable[[], None] | None = None, timeout: float | None = None) -> bool:
        """Write one message (any length: it streams through the slots). Waits while every slot holds a chunk
        some reader has not copied yet; False if that lasted ``timeout`` seconds (the message is then cut off:
        the ring must not be used again)."""
        view = memoryview(data)
        words = self._words
        pos = 0
        while True:
            index = self._count
            slot = index % self.num_slots
            if index >= self.num_slots:  # the slot's previous chunk must have been read by everyone
                free = partial(self._all_read, index - self.num_slots + 1)
                if not wait_until(free, spin_s=self.spin_s, check=check, timeout=timeout):
                    return False
            n = min(len(view) - pos, self.slot_bytes)
            start = self._data_off + slot * self.slot_bytes
            self._bytes[start : start + n] = view[pos : pos + n]
            pos += n
            words[self._slot_word(slot, 1)] = n
            words[self._slot_word(slot, 2)] = int(pos == len(view))
            _fence()
            words[self._slot_word(slot, 0)] = index + 1
            self._count = index + 1
            self._ring_sleepers()
            if pos == len(view):
                return True

    def _ring_sleepers(self) -> None:
        if self.doorbells is None:
            return
        _fence()  # seq before the flags: a reader raises its flag, then reads seq
        words = self._words
        for reader, bell in enumerate(self.doorbells):
            if words[self._reader_word(reader, _SLEEPING)]:
                try:
                    os.write(bell.fileno(), b"\0")
                except (BlockingIOError, BrokenPipeError):
                    pass  # already rung / reader gone

    def _all_read(self, count: int) -> bool:
        words = self._words
        return all(words[self._reader_word(r, _READ)] >= count for r in range(self.num_readers))

    def _published(self, word: int, index: int) -> bool:
        return self._words[word] == index + 1

    def recv(self, check: Callable[[], None] | None = None, timeout: float | None = None) -> bytes | None:
        """Read the next message (waits for it); None if ``timeout`` seconds passed without one."""
        assert self.reader is not None, "recv is for readers"
        words = self._words
        parts = []
        while True:
            index = self._count
            slot = index % self.num_slots
            published = partial(self._published, self._slot_word(slot, 0), index)
            nap = None if self.doorbell is None else partial(self._sleep_until_rung, published)
            if not wait_until(published, spin_s=self.spin_s, check=check, timeout=timeout, nap=nap):
                return None
            _fence()
            n = words[self._slot_word(slot, 1)]
            last = words[self._slot_word(slot, 2)]
            start = self._data_off + slot * self.slot_bytes
            parts.append(bytes(self._bytes[start : start + n]))
            _fence()
            self._count = index + 1
            words[self._reader_word(self.reader, _READ)] = index + 1
            if last:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _sleep_until_rung(self, ready: Callable[[], bool], seconds: float) -> None:
        assert self.doorbell is not None and self.reader is not None
        flag = self._reader_word(self.reader, _SLEEPING)
        self._words[flag] = 1
        _fence()  # the flag before seq: the writer publishes seq, then reads the flag
        try:
            if not ready():
                fd = self.doorbell.fileno()
                if select.select([fd], [], [], seconds)[0]:
                    os.read(fd, 4096)
        finally:
            self._words[flag] = 0

    @property
    def closing(self) -> bool:
        """The writer is going away (set with :meth:`mark_closing`): a reader's failure from now on is expected."""
        return bool(self._words[self._closing_word])

    def mark_closing(self) -> None:
        self._words[self._closing_word] = 1
        _fence()

    # --- reports (reader -> writer) ---------------------------------------------------------------------

    def report(self, reader: int, state: int, text: str = "") -> None:
        """Post ``state`` (and a short text) for ``reader``."""
        raw = text.encode("utf-8", "replace")[:REPORT_BYTES]
        start = reader * REPORT_BYTES
        self._bytes[start : start + len(raw)] = raw
        self._words[self._reader_word(reader, _TEXT)] = len(raw)
        _fence()
        self._words[self._reader_word(reader, _STATE)] = state

    def state(self, reader: int) -> int:
        return self._words[self._reader_word(reader, _STATE)]

    def report_text(self, reader: int) -> str:
        _fence()
        length = self._words[self._reader_word(reader, _TEXT)]
        start = reader * REPORT_BYTES
        return bytes(self._bytes[start : start + length]).decode("utf-8", "replace")

    # --- lifetime ---------------------------------------------------------------------------------------

    def close(self, unlink: bool = False) -> None:
        self._words.release()
        self._bytes.release()
        self.shm.close()
        for bell in self.doorbells or []:
            bell.close()
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
