"""The step loop, and the two places it can run: a thread of the server's process (:class:`EngineThread`) or a
process of its own (:class:`EngineProcess`, vLLM's design: the HTTP and detokenization-free front-end then never
holds the GIL the step loop needs).

The loop takes commands as plain data, ``(call id or None, kind, args)`` with kind ``add`` (request id, token
ids, sampling params), ``abort`` (request id), ``stats`` or ``stop``; between two steps it drains them, runs
them, and hands back ``(results, outputs, now, account)``: each command's ``(call id, result, exception)``, the
outputs (those of aborts and of the step), the time, and its own account (steps, time inside ``step()``, CPU
time of its thread). It blocks on new commands only while the engine has nothing to do. ``stop`` aborts
every request still in the engine and ends the loop.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import operator
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput

Command = tuple[int | None, str, tuple]
Result = tuple[int | None, Any, BaseException | None]


@dataclass
class LoopAccount:
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside engine.step()
    cpu_seconds: float = 0.0  # CPU time of the loop's thread


Emit = Callable[[list[Result], list[RequestOutput], float, LoopAccount], None]

_REQUEST_FIELDS = [f.name for f in dataclasses.fields(RequestOutput) if f.init]
_OUTPUTS_AT, _METRICS_AT = _REQUEST_FIELDS.index("outputs"), _REQUEST_FIELDS.index("metrics")
_PROMPT_IDS_AT = _REQUEST_FIELDS.index("prompt_token_ids")
_request_values = operator.attrgetter(*_REQUEST_FIELDS)
_completion_values = operator.attrgetter(*(f.name for f in dataclasses.fields(CompletionOutput) if f.init))
_metrics_values = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics) if f.init))


def pack_outputs(outputs: list[RequestOutput]) -> list[list]:
    """Outputs as nested tuples and lists of plain values for the pipe: pickled in under half the time of the
    dataclasses (every step sends one per running request). Prompt token ids stay behind: the front-end has them."""
    rows = []
    for out in outputs:
        row = list(_request_values(out))
        row[_PROMPT_IDS_AT] = []
        row[_OUTPUTS_AT] = [_completion_values(c) for c in out.outputs]
        if out.metrics is not None:
            row[_METRICS_AT] = _metrics_values(out.metrics)
        rows.append(row)
    return rows


def unpack_outputs(rows: list[list]) -> list[RequestOutput]:
    outputs = []
    for row in rows:
        row[_OUTPUTS_AT] = [CompletionOutput(*c) for c in row[_OUTPUTS_AT]]
        if row[_METRICS_AT] is not None:
            row[_METRICS_AT] = RequestMetrics(*row[_METRICS_AT])
        outputs.append(RequestOutput(*row))
    return outputs


def run_step_loop(engine: LLMEngine, next_commands: Callable[[bool], list[Command]], emit: Emit) -> None:
    """Run until a ``stop`` command; ``next_commands(block)`` waits for commands only when ``block``."""
    account = LoopAccount()
    live: set[str] = set()  # requests in the engine, as this loop knows them
    while True:
        commands = next_commands(not engine.has_unfinished_requests())
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
            for request_id in list(live):
                out = engine.abort_request(request_id)
                if out is not None:
                    outputs.append(out)
            emit(results, outputs, time.monotonic(), account)
            return
        if results or outputs:  # answer the callers now, not after the step
            emit(results, outputs, time.monotonic(), account)
        if engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            account.step_seconds += time.perf_counter() - start
            account.steps += 1
            account.cpu_seconds = time.thread_time()
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            if outputs:
                emit([], outputs, time.monotonic(), account)


class EngineThread:
    """The step loop in a thread of this process, around an engine built here."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self._cond = threading.Condition()
        self._pending: list[Command] = []
        self._thread: threading.Thread | None = None

    def start(self, emit: Emit, fail: Callable[[BaseException], None]) -> None:
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


def engine_process_main(
    model: str | None,
    config: str | Path | None,
    cli_overrides: dict[str, Any] | None,
    kwargs: dict[str, Any],
    commands: Any,
    outputs: Any,
) -> None:
    """The engine process: build the engine, say ready (or why not), run the loop until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front-end decides
    try:
        engine = LLMEngine(model, config, cli_overrides=cli_overrides, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the front-end, which raises it
        outputs.send(("error", exc))
        return
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


class EngineProcess:
    """The step loop in a process of its own (``spawn``ed: CUDA needs a fresh process), over two pipes."""

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | None = None,
        cli_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_out, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_in = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=engine_process_main,
            args=(model, config, cli_overrides, kwargs, commands_out, outputs_in),
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
        self._reader: threading.Thread | None = None

    def start(self, emit: Emit, fail: Callable[[BaseException], None]) -> None:
        def read() -> None:
            while True:
                try:
                    message = self._outputs.recv()
                except (EOFError, OSError):
                    fail(RuntimeError(f"the engine process exited (status {self.process.exitcode})"))
                    return
                if message[0] == "out":
                    _, results, rows, now, account = message
                    emit(results, unpack_outputs(rows), now, account)
                elif message[0] == "failed":
                    fail(message[1])
                else:  # closed
                    return

        self._reader = threading.Thread(target=read, name="nanovllm-engine-reader", daemon=True)
        self._reader.start()

    def submit(self, commands: list[Command]) -> None:
        self._commands.send(commands)

    def join(self) -> None:
        if self._reader is not None:
            self._reader.join()
        self.process.join(timeout=60)
        atexit.unregister(self._commands.close)
        if self.process.is_alive():
            self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()
