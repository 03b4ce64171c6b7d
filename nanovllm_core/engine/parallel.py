"""Tensor parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs).

Rank 0 runs the engine (scheduler, sampling) and its shard of the model; ranks 1..N-1 are workers that
build the same shard layout and KV cache and run every step on rank 0's decision. Each step rank 0 sends the
step's flattened inputs (:class:`HostBatch`) to the workers; all ranks then run the forward together (the
all-reduces and the logits all-gather inside the layers keep them in step).

With async scheduling rank 0 sends step N+1 while step N still runs: tokens of step N+1 that step N is still
sampling (placeholders) exist only on rank 0's device, so the step that needs them starts with one device-side
broadcast of those tokens from rank 0 (``model_runner.to_model_inputs``), ordered after the sampling by the
device's stream: no rank waits on the host. Decode steps replay CUDA graphs on every rank, with the layers'
all-reduces captured inside them.

Started two ways:
- ``LLM(..., tensor_parallel_size=N)`` on one host spawns N-1 worker processes itself; the step inputs go
  through a shared-memory ring (:mod:`nanovllm_core.engine.shm_ring`), which also carries the workers'
  reports (started; failed, and why);
- under ``torchrun`` (``RANK``/``WORLD_SIZE`` set, ``env://`` rendezvous) every process runs the same
  script, possibly on several hosts: rank 0 returns an engine, the other ranks serve as workers inside the
  ``LLM`` constructor and exit the process when rank 0 shuts down. Step inputs go over a gloo group.

Lifecycle rules (docs/tensor-parallel.md): no rank ever waits for a peer to leave (NCCL communicators are
aborted, not destroyed: a graceful destroy waits for every peer); every wait for a worker has a deadline and
watches the worker's process; Ctrl-C on rank 0 is held while a step is being handed to the workers and run,
so the ranks never fall out of step; workers ignore Ctrl-C (rank 0 decides when they stop).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm_core.config import EngineConfig
from nanovllm_core.distributed import set_peer_failure_check, set_tensor_parallel, setup_symm_mem_all_reduce
from nanovllm_core.engine.shm_ring import BroadcastRing, RingLayout
from nanovllm_core.engine.sigint_hold import SigintHold
from nanovllm_core.errors import ConfigError
from nanovllm_core.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

INIT_TIMEOUT = timedelta(seconds=int(os.environ.get("NANOVLLM_TP_TIMEOUT", "300")))
WORKER_ENV = "NANOVLLM_TP_WORKER"  # "<ring layout>;<rank>": set only in the processes this module spawns
PORT_ENV = "NANOVLLM_TP_PORT"  # rendezvous port of a spawned group (data parallelism gives each replica its own)
STARTED, FAILED = 1, 2  # a worker's state in its ring report (0 until it reports)
EXIT_DEADLINE_S = 2.0  # how long shutdown waits for the workers to leave before it terminates them
LEAVE_DEADLINE_S = 1.5  # how long a rank waits for its own leaving of the process group (an NCCL abort can hang)
MAIN_GUARD_EXIT = 3  # exit code of a worker that found itself re-importing an unguarded main module


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process ended while the engine needed it: the engine cannot continue."""


@dataclass
class RunnerSpec:
    """Everything a rank needs to build its model runner, pickled to a spawned worker: the front-end's finished,
    frozen config (it stays finished through pickling, so no rank resolves anything again)."""

    config: EngineConfig
    architecture: str
    attention: str
    device_type: str
    dtype: str


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def local_device(device_type: str, rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def spin_seconds(device_type: str) -> float:
    """How long a waiting worker spins before it sleeps on its doorbell. On a GPU rank 0's host work between two
    steps takes a few milliseconds and cores are plentiful; on a CPU the ranks share the cores that compute."""
    return 0.05 if device_type == "cuda" else 0.001


def limit_cpu_threads(device_type: str, world_size: int) -> None:
    if device_type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def init_distributed(
    rank: int, world_size: int, init_method: str, device_type: str, control: bool = False
) -> dist.ProcessGroup | None:
    """Join the process group; with ``control``, also return a gloo group for control messages."""
    device = local_device(device_type, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
        # torch's abort (how every rank leaves) is to be used with NCCL's own asynchronous error handling off,
        # whose watchdog otherwise races it to tear the communicators down; a dead peer is noticed by ours.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=INIT_TIMEOUT)
    set_tensor_parallel(rank, world_size)
    setup_symm_mem_all_reduce(device)  # a collective, off unless its environment variables ask for it
    if not control:
        return None
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def leave_distributed(device_type: str) -> None:
    """Leave the process group without waiting for any other rank. NCCL communicators are aborted: a graceful
    destroy flushes with every peer and hangs when one is gone or out of step. gloo's destroy only closes this
    rank's connections (a peer blocked in a collective with this rank gets an error instead of waiting)."""
    set_tensor_parallel(0, 1)
    if not dist.is_initialized():
        return
    if device_type == "cuda":
        try:
            dist.distributed_c10d._abort_process_group()  # noqa: SLF001 - the public destroy waits for peers
            return
        except Exception:  # noqa: BLE001 - an older torch without it: the graceful path
            logger.debug("aborting the NCCL process group failed; destroying it", exc_info=True)
    dist.destroy_process_group()


def leave_distributed_within(device_type: str, seconds: float) -> bool:
    """:func:`leave_distributed`, given ``seconds``: False if it had not returned by then. On two H200s the NCCL
    abort once hung on both ranks after a finished run (8B shape, TP=2); it then goes on in a daemon thread and
    the caller carries on (a worker exits, rank 0 returns from shutdown). At interpreter exit no thread can be
    started: it runs inline there. gloo's destroy cannot hang (it closes this rank's connections only) and runs
    inline too: a process that exits with a gloo group not yet destroyed can abort in its finalization (gloo's
    threads still hold work with tensors in them), which a leave still running in a thread would allow."""
    done = threading.Event()

    def leave() -> None:
        try:
            leave_distributed(device_type)
        except Exception:  # noqa: BLE001 - leaving is best effort: the process (or the next engine) goes on
            logger.debug("leaving the process group failed", exc_info=True)
        finally:
            done.set()

    if device_type != "cuda":
        leave()
        return True
    try:
        threading.Thread(target=leave, name="nanovllm-tp-leave", daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python 3.12)
        leave()
        return True
    if done.wait(seconds):
        return True
    logger.warning(
        "leaving the NCCL process group did not finish within %.0f s; going on without it (this process cannot "
        "start another tensor-parallel engine)",
        seconds,
    )
    return False


def build_runner(spec: RunnerSpec, rank: int):
    """Build this rank's runner from its own plugin registry (every process loads the plugins itself)."""
    from nanovllm_core.engine.model_runner import ModelRunner
    from nanovllm_core.loader import load_hf_config
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    config = spec.config
    hf_config = load_hf_config(config.model)
    model_cls = registry.get("model", spec.architecture).obj
    backend_cls = registry.get("attention", spec.attention).obj
    return ModelRunner(
        config, hf_config, model_cls, backend_cls, local_device(spec.device_type, rank), getattr(torch, spec.dtype)
    )


def serve(runner: Any, receive: Callable[[], tuple[str, Any]]) -> None:
    """A worker's loop: run every step rank 0 announces, until it says ``exit``."""
    while True:
        kind, payload = receive()
        if kind == "step":
            runner.run_step(payload)
        elif kind == "exit":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r} (expected 'step' or 'exit')")


class _ParentGone(Exception):
    pass


def worker_main(
    rank: int, world_size: int, init_method: str, spec: RunnerSpec, layout: RingLayout, doorbell: Connection
) -> None:
    """A spawned worker: report in, join the group, build the shard, serve; never returns (``os._exit``: the
    interpreter's teardown has nothing left to save and NCCL's static destructors can hang or abort)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    os.environ.pop(WORKER_ENV, None)
    parent = os.getppid()
    reader = rank - 1
    ring = BroadcastRing.attach(layout, reader=reader, doorbell=doorbell)
    code = 0
    runner = None

    def check_parent() -> None:
        if os.getppid() != parent:
            raise _ParentGone

    try:
        limit_cpu_threads(spec.device_type, world_size)
        if spec.device_type == "cuda":
            torch.cuda.set_device(local_device("cuda", rank))
        ring.report(reader, STARTED)
        init_distributed(rank, world_size, init_method, spec.device_type)
        runner = build_runner(spec, rank)
        freeze_startup_heap()  # a worker process: its start-up heap stays out of full collections
        ring.spin_s = spin_seconds(spec.device_type)
        serve(runner, lambda: pickle.loads(ring.recv(check=check_parent)))
    except _ParentGone:
        code = 1
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it there
        if not ring.closing:  # else rank 0 left mid-step (shut down from another thread): nothing went wrong here
            ring.report(reader, FAILED, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
            code = 1
    finally:
        try:
            if runner is not None and code == 0 and spec.device_type == "cuda":  # (a stuck collective never syncs)
                runner.release_cuda_graphs()
            leave_distributed_within(spec.device_type, LEAVE_DEADLINE_S)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def serve_torchrun(rank: int, world_size: int, spec: RunnerSpec) -> None:
    """A torchrun worker (rank > 0): serve until rank 0 shuts down (step inputs over a gloo group)."""
    limit_cpu_threads(spec.device_type, world_size)
    control = init_distributed(rank, world_size, "env://", spec.device_type, control=True)

    def receive() -> Any:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        return message[0]

    try:
        serve(build_runner(spec, rank), receive)
        dist.barrier(group=control)  # every rank got 'exit': rank 0 may leave without cutting a message short
    finally:
        leave_distributed(spec.device_type)


def refuse_inside_worker() -> None:
    """Raise a clear error (and tell rank 0 why) when a spawned worker is asked to build a tensor-parallel
    engine: that happens only when the spawn start method re-imports a main module that builds one at import
    time, i.e. a script without the ``if __name__ == "__main__":`` guard."""
    value = os.environ.get(WORKER_ENV)
    if value is None:
        return
    layout_text, rank = value.rsplit(";", 1)
    frame, main = sys._getframe(), "the main module"
    while frame is not None:  # the re-imported script runs as __mp_main__
        if frame.f_globals.get("__name__") == "__mp_main__":
            main = frame.f_globals.get("__file__", main)
            break
        frame = frame.f_back
    message = (
        f"a tensor-parallel worker re-imported {main} and it built an LLM again: the workers are started with the "
        "'spawn' method, which imports the main module in every worker. Put the code that builds the LLM under "
        '`if __name__ == "__main__":` (see docs/tensor-parallel.md)'
    )
    try:
        ring = BroadcastRing.attach(RingLayout.decode(layout_text), reader=int(rank) - 1)
        ring.report(int(rank) - 1, FAILED, message)
        ring.close()
    finally:
        print(f"nanovllm: {message}", file=sys.stderr, flush=True)
        os._exit(MAIN_GUARD_EXIT)


def rendezvous_port() -> int:
    """The port of a spawned group's rendezvous: ``NANOVLLM_TP_PORT`` when set (data-parallel replicas get distinct
    ports from their front process, so that two replicas starting at once cannot pick the same one), else a free one."""
    value = os.environ.get(PORT_ENV)
    if not value:
        return free_port()
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(f"{PORT_ENV}={value!r} is not a TCP port (an integer from 1 to 65535)")
    return int(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


# --- one tensor-parallel engine per process ---------------------------------------------------------------

_current: weakref.ref[TensorParallelGroup] | None = None


def _claim_process() -> None:
    """torch.distributed has one default process group per process, so one tensor-parallel engine at a time.
    An engine that was deleted but not yet collected (reference cycles) is collected here, which shuts it down."""
    if _current is not None and _current() is not None and not _current().closed:
        gc.collect()
    if _current is not None and _current() is not None and not _current().closed:
        raise ConfigError(
            "another tensor-parallel engine is still running in this process (torch.distributed allows one "
            "process group per process): call shutdown() on it first, or use `with LLM(...) as llm:`"
        )
    if dist.is_initialized():
        raise ConfigError(
            "torch.distributed is already initialized in this process (not by nanovllm, or a previous engine's "
            "NCCL group that could not be aborted at its shutdown: see the warning logged then); a tensor-parallel "
            "engine creates its own process group: destroy the existing one first (dist.destroy_process_group()), "
            "or start the engine in a new process"
        )


class TensorParallelGroup:
    """Rank 0's side: starts (or joins) the workers, tells them what to run, watches them, stops them."""

    def __init__(self, spec: RunnerSpec, world_size: int) -> None:
        global _current
        refuse_inside_worker()
        _claim_process()
        _current = weakref.ref(self)
        self.world_size = world_size
        self.device_type = spec.device_type
        self.processes: list[mp.Process] = []
        self.closed = False
        self.failure: str | None = None  # why the group cannot go on (set by the watchdog)
        self.ring: BroadcastRing | None = None
        self.control: dist.ProcessGroup | None = None
        self._threads = torch.get_num_threads()
        self._sigint = SigintHold()
        self._wake_r, self._wake_w = os.pipe()
        self._watchdog: threading.Thread | None = None
        self._send_lock = threading.Lock()  # one writer in the ring: a step, or the exit from another thread
        try:
            limit_cpu_threads(spec.device_type, world_size)
            if launched_by_torchrun():
                self.control = init_distributed(0, world_size, "env://", spec.device_type, control=True)
            else:
                self._spawn(spec)
            set_peer_failure_check(self.check)
        except BaseException:
            self.close()
            raise

    # --- start-up -------------------------------------------------------------------------------------

    def _spawn(self, spec: RunnerSpec) -> None:
        init_method = f"tcp://127.0.0.1:{rendezvous_port()}"
        self.ring = BroadcastRing.create(self.world_size - 1)
        self.ring.spin_s = spin_seconds(spec.device_type)
        doorbells = self.ring.make_doorbells()
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, self.world_size):
                os.environ[WORKER_ENV] = f"{self.ring.layout.encode()};{rank}"
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, self.world_size, init_method, spec, self.ring.layout, doorbells[rank - 1]),
                    name=f"nanovllm-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self.processes.append(proc)
        finally:  # unset before (refuse_inside_worker): set only for the workers to inherit
            os.environ.pop(WORKER_ENV, None)
        self._wait_started()
        self._watchdog = threading.Thread(target=self._watch, name="nanovllm-tp-watchdog", daemon=True)
        self._watchdog.start()
        init_distributed(0, self.world_size, init_method, spec.device_type)

    def _wait_started(self) -> None:
        """Wait until every worker reported in, failing at once (with its reason) if one ends first."""
        deadline = time.monotonic() + INIT_TIMEOUT.total_seconds()
        ring = self.ring
        assert ring is not None
        while not all(ring.state(rank - 1) == STARTED for rank in range(1, self.world_size)):
            for rank, proc in enumerate(self.processes, start=1):
                if not proc.is_alive() or ring.state(rank - 1) == FAILED:
                    proc.join(1)
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {self._reason(rank)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel workers did not start within {INIT_TIMEOUT.total_seconds():.0f} s "
                    "(NANOVLLM_TP_TIMEOUT)"
                )
            wait_for_any([p.sentinel for p in self.processes], timeout=0.05)

    def _reason(self, rank: int) -> str:
        proc = self.processes[rank - 1]
        text = self.ring.report_text(rank - 1) if self.ring is not None else ""
        exit_text = describe_exit(proc.exitcode)
        if text:
            return f"{text} ({exit_text})"
        if proc.exitcode is not None and proc.exitcode > 0:
            return f"{exit_text}; its error output is above"
        return exit_text

    def _watch(self) -> None:
        """Watchdog thread: notice a worker that ends while the engine runs, say so, and unblock rank 0."""
        pending = {proc.sentinel: rank for rank, proc in enumerate(self.processes, start=1)}
        while pending:
            ready = wait_for_any([*pending, self._wake_r])
            if self._wake_r in ready or self.closed:
                return
            for sentinel in ready:
                rank = pending.pop(sentinel)
                self.processes[rank - 1].join(1)
                self._worker_died(rank)

    def _worker_died(self, rank: int) -> None:
        if self.closed:
            return
        if self.failure is None:
            self.failure = f"rank {rank} ({self._reason(rank)})"
        logger.error("tensor-parallel worker died: %s", self.failure)
        if self.device_type == "cuda":
            # rank 0 may be waiting on a collective with the dead rank inside the GPU; only an abort ends it
            try:
                dist.distributed_c10d._abort_process_group()  # noqa: SLF001
            except Exception:  # noqa: BLE001
                logger.debug("aborting the NCCL process group after a worker died failed", exc_info=True)

    # --- steps ----------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`WorkerDiedError` if the group cannot run a step."""
        if self.closed:
            raise RuntimeError("the engine was shut down (its tensor-parallel workers are gone): create a new one")
        if self.failure is None:
            for rank, proc in enumerate(self.processes, start=1):
                if not proc.is_alive():  # the watchdog may not have run yet
                    self.failure = f"rank {rank} ({self._reason(rank)})"
                    break
        if self.failure is not None:
            raise WorkerDiedError(
                f"tensor-parallel worker died: {self.failure}; the engine cannot continue: shut it down and "
                "create a new one"
            )

    def send_step(self, host: Any) -> None:
        """Hand one step's inputs to the workers (the model runner's ``on_step``). Ctrl-C is held until the
        caller (the runner's step, which runs the forward and its collectives) returns."""
        caller = sys._getframe(1)
        if not self._sigint.tried:
            self._sigint.install()  # from the thread that drives the engine: the main thread's handler only
        self._sigint.deliver_pending(caller)  # a Ctrl-C held since the last step: now, before this one starts
        self._sigint.hold(caller)
        self.check()
        with self._send_lock:
            self._send(("step", host))

    def _send(self, message: tuple[str, Any]) -> bool:
        if self.ring is not None:
            return self.ring.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), self.check)
        dist.broadcast_object_list([message], src=0, group=self.control)
        return True

    # --- shutdown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers: tell them to leave, leave the process group, wait for them (at most a few seconds,
        then terminate). Never waits on a peer without a deadline; safe to call twice, from a finalizer, at
        interpreter exit (where the group is left inline: no thread can start then) and after a failure."""
        global _current
        if self.closed:
            return
        self._sigint.hold(sys._getframe())
        healthy = self.failure is None and all(p.is_alive() for p in self.processes)
        self.closed = True
        if self.ring is not None:
            self.ring.mark_closing()
        try:
            told = self._say_exit(healthy)
            leave_distributed_within(self.device_type, LEAVE_DEADLINE_S)
            self._stop_workers(EXIT_DEADLINE_S if told else 0.2)
        finally:
            os.write(self._wake_w, b"x")
            if self._watchdog is not None and self._watchdog is not threading.current_thread():
                self._watchdog.join(1)
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self.ring is not None:
                self.ring.close(unlink=True)
            torch.set_num_threads(self._threads)
            self._sigint.uninstall()
            if _current is not None and _current() is self:
                _current = None

    def _say_exit(self, healthy: bool) -> bool:
        """Tell the workers to leave; True if the message went out. Through the ring even when a worker died
        (the others still read it); over gloo (torchrun) only when every rank is there to receive it."""
        if not self._send_lock.acquire(timeout=1.0):  # a thread stuck in a send (shutdown from another thread)
            return False
        try:
            if self.ring is not None:
                return self.ring.send(pickle.dumps(("exit", None)), timeout=0.5)
            if healthy and dist.is_initialized():
                self._send(("exit", None))
                dist.barrier(group=self.control)
                return True
        except Exception:  # noqa: BLE001 - a peer is gone: the workers are stopped regardless
            logger.debug("the tensor-parallel exit message failed", exc_info=True)
        finally:
            self._send_lock.release()
        return False

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not exit in time; terminating it", proc.name)
                proc.terminate()
        for proc in self.processes:
            proc.join(0.3)  # a stopped (SIGSTOP) process never acts on SIGTERM: only the kill ends it
            if proc.is_alive():
                proc.kill()
                proc.join(1)
