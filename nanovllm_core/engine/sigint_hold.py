"""Hold Ctrl-C while a function runs whose interruption would leave other processes waiting.

Tensor parallelism: once rank 0 has announced a step, every rank must run that step's collectives. A
KeyboardInterrupt between two of them leaves the workers waiting inside the step while rank 0 starts the
next one, and the ranks never meet again. So rank 0's SIGINT handler looks at the interrupted stack: while
the held function (the caller of the step announcement) is on it, the interrupt is kept pending and
delivered at the next safe point: when the next step is about to be announced, or, if none comes, at the
first retry (every few milliseconds) that finds the function gone.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class SigintHold:
    """``install()`` in the main thread; ``hold(frame)`` marks a function that must not be interrupted;
    ``deliver_pending()`` raises a held interrupt at a safe point; ``uninstall()`` restores the old handler.

    The handler chains to the one it replaced (Python's default raises KeyboardInterrupt; asyncio's cancels
    its main task), so install it late, when the first held function runs: a handler installed earlier, e.g.
    by ``asyncio.run``, stays in charge."""

    RETRY_S = 0.01

    def __init__(self) -> None:
        self.previous: Any = None
        self.installed = False
        self.tried = False  # install() ran (whether or not it could install)
        self.pending = False
        self._held: tuple[int, Any] | None = None  # (id, code) of the held frame: no reference keeps it alive
        self._retry: threading.Timer | None = None

    def install(self) -> None:
        self.tried = True
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread: an engine driven from another thread needs no hold
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            return  # SIG_IGN, SIG_DFL or set outside Python: the user chose, leave it
        self.previous = previous
        signal.signal(signal.SIGINT, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self.previous)
        self.installed = False

    def hold(self, frame: FrameType) -> None:
        """Hold Ctrl-C until ``frame``'s function returns."""
        self._held = (id(frame), frame.f_code)

    def deliver_pending(self, frame: FrameType | None) -> None:
        """At a safe point (nothing held needs to finish): raise the interrupt that was held, if any."""
        if self.pending:
            self.pending = False
            self._held = None
            self.previous(signal.SIGINT, frame)

    def _holding(self, frame: FrameType | None) -> bool:
        if self._held is None:
            return False
        held_id, held_code = self._held
        while frame is not None:
            if id(frame) == held_id and frame.f_code is held_code:
                return True
            frame = frame.f_back
        self._held = None
        return False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._holding(frame):
            self.pending = True
            self._retry_later()
            return
        self.pending = False
        self.previous(signum, frame)

    def _retry_later(self) -> None:
        if self._retry is not None and self._retry.is_alive():
            return
        self._retry = threading.Timer(self.RETRY_S, self._resend, (threading.main_thread().ident,))
        self._retry.daemon = True
        try:
            self._retry.start()
        except RuntimeError:  # interpreter shutdown: no new thread; the held function delivers it, or exit does
            self._retry = None

    def _resend(self, main: int) -> None:
        if self.pending and self.installed:
            signal.pthread_kill(main, signal.SIGINT)
