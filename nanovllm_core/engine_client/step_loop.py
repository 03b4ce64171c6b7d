"""The step loop, and the two places it can run: a thread of this process (:class:`InProcessClient`) or a
process of its own (:class:`EngineProcess`, vLLM's design: the HTTP and detokenization-free front-end then never
holds the GIL the step loop needs).

Between two steps the loop drains the commands of :class:`~nanovllm_core.engine_client.base.EngineClient`, runs them
and hands back their results with the outputs (those of aborts and of the step), the time and its own
:class:`LoopAccount` (steps, time inside ``step()``, CPU time of its thread). It blocks on new commands only while
the engine has nothing to do.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import multiprocessing
import operator
import os
import pickle
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineCore, EngineStats
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine_client.base import Command, Emit, EngineClient, Fail, Inbox, LoopAccount, Result
from nanovllm_core.gc_heap import freeze_startup_heap
from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput

_REQUEST_FIELDS = [f.name for f in dataclasses.fields(RequestOutput) if f.init]
_OUTPUTS_AT, _METRICS_AT = _REQUEST_FIELDS.index("outputs"), _REQUEST_FIELDS.index("metrics")
_PROMPT_IDS_AT = _REQUEST_FIELDS.index("prompt_token_ids")
_request_values = operator.attrgetter(*_REQUEST_FIELDS)
_completion_values = operator.attrgetter(*(f.name for f in dataclasses.fields(CompletionOutput) if f.init))
_metrics_values = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics) if f.init))


def pack_outputs(outputs: list[RequestOutput]) -> list[list | tuple]:
    """Outputs as nested tuples and lists of plain values for the pipe: pickled in under half the time of the
    dataclasses (every step sends one per running request). Prompt token ids stay behind: the front-end has them.

    The common streamed output (unfinished, one sample, token ids only: the front-end decodes the text) goes as
    ``(request id, sample index, token ids, cached prompt tokens)``, a quarter of a full row's pickling time; such
    intermediate outputs arrive without ``metrics`` (the finished output carries them)."""
    rows: list[list | tuple] = []
    for out in outputs:
        if not out.finished and len(out.outputs) == 1 and out.prompt_logprobs is None and out.error is None:
            c = out.outputs[0]
            if not c.text and c.logprobs is None and c.finish_reason is None:
                rows.append((out.request_id, c.index, c.token_ids, out.num_cached_tokens))
                continue
        row = list(_request_values(out))
        row[_PROMPT_IDS_AT] = []
        row[_OUTPUTS_AT] = [_completion_values(c) for c in out.outputs]
        if out.metrics is not None:
            row[_METRICS_AT] = _metrics_values(out.metrics)
        rows.append(row)
    return rows


def unpack_outputs(rows: list[list | tuple]) -> list[RequestOutput]:
    outputs = []
    for row in rows:
        if type(row) is tuple:
            request_id, index, token_ids, num_cached = row
            outputs.append(
                RequestOutput(request_id, None, [], [CompletionOutput(index, "", token_ids)], False, num_cached)
            )
            continue
        row[_OUTPUTS_AT] = [CompletionOutput(*c) for c in row[_OUTPUTS_AT]]
        if row[_METRICS_AT] is not None:
            row[_METRICS_AT] = RequestMetrics(*row[_METRICS_AT])
        outputs.append(RequestOutput(*row))
    return outputs


class StepLoop:
    """One engine served by commands: :meth:`run` runs a batch of them, :meth:`step` one engine step; both hand their
    results and outputs to ``emit``. The outputs are the core's (token ids): the front-end they go to makes the text."""

    def __init__(self, engine: EngineCore, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit
        self.account = LoopAccount()
        self.live: set[str] = set()  # requests in the engine, as this loop knows them

    def hand_over(self, results: list[Result], outputs: list[RequestOutput]) -> None:
        start = time.perf_counter()
        self.emit(results, outputs, time.monotonic(), self.account)
        self.account.emit_seconds += time.perf_counter() - start

    def run(self, commands: list[Command]) -> bool:
        """Run and answer ``commands``; True when one was ``stop`` (then every request left is aborted)."""
        engine, live = self.engine, self.live
        results: list[Result] = []
        outputs: list[RequestOutput] = []
        stopping = False
        for call_id, kind, args in commands:
            if kind == "stop":
                stopping = True
                continue
            try:
                result = None
                if kind == "add":
                    engine.add_request(*args)
                    live.add(args[2])
                elif kind == "abort":
                    out = engine.abort_request(*args)
                    if out is not None:
                        if out.finished:
                            live.discard(out.request_id)
                        outputs.append(out)
                elif kind == "stats":
                    result = engine.stats()
                else:
                    raise ValueError(f"unknown step-loop command {kind!r}")
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                results.append((call_id, None, exc))
                continue
            results.append((call_id, result, None))
        if stopping:
            outputs += filter(None, (engine.abort_request(request_id) for request_id in list(live)))
        if results or outputs or stopping:  # answer the callers now, not after the step
            self.hand_over(results, outputs)
        return stopping

    def step(self) -> None:
        """One engine step, when it has work."""
        if not self.engine.has_unfinished_requests():
            return
        start = time.perf_counter()
        outputs = self.engine.step()
        self.account.count_step(time.perf_counter() - start)
        self.account.cpu_seconds = time.thread_time()
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        if outputs:
            self.hand_over([], outputs)


def run_step_loop(engine: EngineCore, next_commands: Callable[[bool], list[Command]], emit: Emit) -> None:
    """Run until a ``stop`` command; ``next_commands(block)`` waits for commands only when ``block``."""
    loop = StepLoop(engine, emit)
    while not loop.run(next_commands(not engine.has_unfinished_requests())):
        loop.step()


def on_loop(loop: Any, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, called from any thread, run on the asyncio event loop ``loop`` (dropped once it is closed)."""

    def call(*args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    return call


class InProcessClient(EngineClient):
    """An engine core in this process. ``LLM`` and ``LLMEngine`` drive it in the caller's thread (the pull path runs
    each command at once, and one engine step where it would wait for outputs); ``AsyncLLM`` runs its step loop in a
    thread of this process (:meth:`start`)."""

    def __init__(self, engine: ModelEngineCore) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        self.hf_config = engine.hf_config
        self.eos_token_ids = engine.eos_token_ids
        self._cond = threading.Condition()
        self._pending: list[Command] = []
        self._thread: threading.Thread | None = None
        self._driven: StepLoop | None = None  # the pull path's, in the caller's thread

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _start_pull(self, inbox: Inbox) -> None:
        self._driven = StepLoop(self.engine, inbox.emit)
        inbox.drive = self._driven.step

    # --- push: the step loop in a thread ---------------------------------------------------------------

    def start(self, emit: Emit, fail: Fail, loop: Any = None) -> None:
        """Run the loop in a thread; with ``loop`` (an asyncio event loop), ``emit`` and ``fail`` are called on it."""
        if loop is not None:
            emit, fail = on_loop(loop, emit), on_loop(loop, fail)

        def run() -> None:
            try:
                device = self.engine.device
                if device.type == "cuda":  # the model's device ("cuda" alone: the one current at start-up)
                    import torch

                    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
                run_step_loop(self.engine, self._next_commands, emit)
            except BaseException as exc:  # noqa: BLE001 - every waiting caller learns why
                fail(exc)

        self._thread = threading.Thread(target=run, name="nanovllm-step-loop", daemon=True)
        self._thread.start()

    def _next_commands(self, block: bool) -> list[Command]:
        with self._cond:
            while block and not self._pending:
                self._cond.wait()
            commands, self._pending = self._pending, []
        return commands

    def submit(self, commands: list[Command]) -> None:
        if self._driven is not None:
            self._driven.run(commands)
            return
        with self._cond:
            self._pending.extend(commands)
            self._cond.notify()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


LogSetup = tuple[int, str | None, str | None]  # level, format, date format


def stderr_log_setup() -> LogSetup | None:
    """How this process logs: its root logger's level and the format of its handler to stderr (``basicConfig``'s,
    as ``nanovllm serve`` sets it up), for an engine process to log the same way to the same stderr; None when no
    such handler is set up (a library caller's engine process then logs as Python does by default)."""
    root = logging.getLogger()
    for handler in root.handlers:
        if type(handler) is logging.StreamHandler and handler.stream is sys.stderr:
            formatter = handler.formatter
            fmt = getattr(formatter, "_fmt", None)
            return root.getEffectiveLevel(), fmt, getattr(formatter, "datefmt", None)
    return None


def engine_process_main(
    build: Callable[[], Any], commands: Any, outputs: Any, log_setup: LogSetup | None = None
) -> None:
    """The engine process: log as the front-end does (``log_setup``), build the engine (``build()``, a
    ModelEngineCore in a server), say ready (or why not), run the loop until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front-end decides
    if log_setup is not None:  # a spawned process starts without the parent's logging set-up
        level, fmt, datefmt = log_setup
        logging.basicConfig(level=level, format=fmt, datefmt=datefmt, stream=sys.stderr)
    try:
        engine = build()
    except BaseException as exc:  # noqa: BLE001 - reported to the front-end, which raises it
        outputs.send(("error", exc))
        return
    freeze_startup_heap()  # this process is the engine's own: keep its start-up heap out of full collections
    outputs.send(("ready", engine.config))

    def next_commands(block: bool) -> list[Command]:
        batch: list[Command] = []
        try:
            if block or commands.poll():
                batch.extend(commands.recv())
            while commands.poll():
                batch.extend(commands.recv())
        except (EOFError, OSError):  # the front-end is gone (or exiting): abort everything and end
            batch.append((None, "stop", ()))
        return batch

    def send(message: tuple) -> None:
        try:
            outputs.send(message)
        except (BrokenPipeError, OSError):  # the front-end is gone: nobody is left to tell
            pass

    def emit(results: list[Result], outs: list[RequestOutput], now: float, account: LoopAccount) -> None:
        send(("out", results, pack_outputs(outs), now, account))

    try:
        run_step_loop(engine, next_commands, emit)
    except BaseException as exc:  # noqa: BLE001
        send(("failed", exc))
    finally:
        engine.shutdown()
        send(("closed",))


def frame_message(payload: bytes) -> bytes:
    """``payload`` framed as ``Connection.send_bytes`` frames it (a 4-byte big-endian length; payloads over 2 GiB
    do not occur here), so that the engine process reads it with ``Connection.recv``; :class:`FrameReader` reads
    the other direction."""
    return struct.pack("!i", len(payload)) + payload


class FrameReader:
    """Cuts a byte stream written by ``Connection.send`` into its messages (unpickled), as bytes arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buffer = self._buffer
        buffer += data
        messages, at = [], 0
        with memoryview(buffer) as view:
            while len(buffer) - at >= 4:
                (size,) = struct.unpack_from("!i", buffer, at)
                start = at + 4
                if size == -1:  # a payload over 2 GiB: an 8-byte length follows
                    if len(buffer) - at < 12:
                        break
                    (size,) = struct.unpack_from("!Q", buffer, start)
                    start += 8
                if len(buffer) - start < size:
                    break
                messages.append(pickle.loads(view[start : start + size]))
                at = start + size
        del buffer[:at]
        return messages


def _widen_pipe(connection: Any) -> None:
    """Give a pipe 1 MiB of buffer (Linux; 64 KiB by default): the engine then never waits on a front-end that
    is busy for a few steps, and takes in a burst of requests in one drain."""
    try:
        import fcntl

        fcntl.fcntl(connection.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):  # another OS, or above /proc/sys/fs/pipe-max-size: keep the default
        pass


class EngineProcess(EngineClient):
    """The step loop in a process of its own (``spawn``ed: CUDA needs a fresh process), over two pipes.

    ``EngineProcess(config)`` builds a :class:`ModelEngineCore` of that :class:`EngineConfig` there; ``build`` (a
    picklable callable returning an engine-like object) builds something else, as benchmarks do.
    """

    def __init__(self, config: EngineConfig | None = None, *, build: Callable[[], Any] | None = None) -> None:
        if build is None:
            if config is None:
                raise TypeError("EngineProcess needs an EngineConfig or a build callable")
            build = functools.partial(ModelEngineCore, config=config)
        ctx = multiprocessing.get_context("spawn")
        commands_out, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_in = ctx.Pipe(duplex=False)
        _widen_pipe(self._outputs)
        _widen_pipe(self._commands)  # a burst of requests (2 KB each with 600-token prompts) fits in one drain
        self.process = ctx.Process(
            target=engine_process_main,
            args=(build, commands_out, outputs_in, stderr_log_setup()),
            name="nanovllm-engine",
            daemon=False,  # a daemonic process may not start the tensor-parallel workers
        )
        self.process.start()
        # at interpreter exit multiprocessing joins the process: closing the commands pipe first ends its loop
        atexit.register(self._commands.close)
        commands_out.close()
        outputs_in.close()
        try:
            kind, payload = self._outputs.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine process exited with status {self.process.exitcode} while starting"
            ) from None
        if kind == "error":
            self.process.join()
            raise payload
        self.config: EngineConfig = payload
        self._started = False
        self._ended = threading.Event()  # the outputs pipe said "closed" (or broke)
        self._loop: Any = None
        self._outbox = bytearray()  # framed commands not yet written (on an event loop: the pipe was full)

    def start(self, emit: Emit, fail: Fail, loop: Any = None) -> None:
        """Deliver the loop's messages: on ``loop`` (an asyncio event loop, whose thread calls this), reading the
        pipe when it is readable, else from a reader thread. On the event loop no thread competes for the GIL:
        a reader thread that has to win it back from a busy event loop after every read waits a switch
        interval (5 ms) each time, and the engine then waits on the full pipe."""

        def handle(message: tuple) -> bool:
            """Act on one message; False once nothing more will come."""
            if message[0] == "out":
                _, results, rows, now, account = message
                emit(results, unpack_outputs(rows), now, account)
                return True
            if message[0] == "failed":
                fail(message[1])
                return True
            return False  # closed

        self._started = True

        def broken() -> None:
            fail(RuntimeError(f"the engine process exited (status {self.process.exitcode})"))

        if loop is not None:
            self._loop = loop
            os.set_blocking(self._commands.fileno(), False)
            fd = self._outputs.fileno()
            # Non-blocking reads of whatever has arrived, cut into messages here: uvloop makes a watched fd
            # non-blocking, where Connection.recv fails on a message only partly written, and a blocking recv
            # would stall the event loop until the engine finished writing.
            os.set_blocking(fd, False)
            frames = FrameReader()

            def on_readable() -> None:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if data:
                    for message in frames.feed(data):
                        if not handle(message):
                            break
                    else:
                        return
                else:  # end of file: the engine process is gone
                    broken()
                loop.remove_reader(fd)
                self._ended.set()

            loop.add_reader(fd, on_readable)
            return

        def read() -> None:
            try:
                while handle(self._outputs.recv()):
                    pass
            except (EOFError, OSError):
                broken()
            finally:
                self._ended.set()

        threading.Thread(target=read, name="nanovllm-engine-reader", daemon=True).start()

    def submit(self, commands: list[Command]) -> None:
        """Send commands. On an event loop this never blocks: an event loop blocked on a full commands pipe would
        stop reading the outputs pipe, and the engine, blocked on that, would stop reading commands."""
        if self._loop is None:
            self._commands.send(commands)
            return
        waiting = bool(self._outbox)  # if so, the writer callback is registered and writes this after it
        self._outbox += frame_message(pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL))
        if not waiting:
            self._flush()

    def _flush(self) -> None:
        fd = self._commands.fileno()
        try:
            written = os.write(fd, self._outbox)
        except BlockingIOError:
            written = 0
        except OSError:  # the engine process is gone: the outputs pipe says so
            written = len(self._outbox)
        del self._outbox[:written]
        if self._outbox:
            self._loop.add_writer(fd, self._flush)
        else:
            self._loop.remove_writer(fd)

    def join(self) -> None:
        if self._started:
            self._ended.wait(timeout=60)
        self.process.join(timeout=60)
        atexit.unregister(self._commands.close)
        if self.process.is_alive():
            self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()
