"""Data parallelism: ``data_parallel_size`` engine replicas, each in a process of its own on its own GPUs (or CPU),
behind one :class:`~nanovllm_core.engine_client.base.EngineClient`.

:class:`DataParallelClient` holds the replicas (each an :class:`~nanovllm_core.engine_client.step_loop.EngineProcess`)
and serves ``LLM`` (pull) and ``AsyncLLM`` (push) as one engine would. It routes each ``add`` through its
:class:`~nanovllm_data_parallel.router.Router` (the replica holding the prompt's prefix, else the one with the
least outstanding work), each ``abort`` to the replica that owns the request, answers ``stats`` from every
replica's stats, and sends ``stop`` to all. :class:`~nanovllm_data_parallel.ray_client.RayDataParallelClient`
is this client with Ray actors for replicas.

Replica ``r`` of ``N`` with ``tensor_parallel_size`` ``T`` runs on GPUs ``r*T .. (r+1)*T - 1`` (of the GPUs this
process sees): its process sets ``CUDA_VISIBLE_DEVICES`` to them before CUDA starts, so inside it they are
``cuda:0 .. cuda:T-1`` and its tensor-parallel ranks need nothing else; its tensor-parallel group gets a
rendezvous port of its own (``NANOVLLM_TP_PORT``). On CPU every replica is a process with ``cpu_count // N``
threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.config_resolver import finish_config, resolve_device
from nanovllm_core.engine.core import EngineStats
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine.parallel import PORT_ENV, launched_by_torchrun
from nanovllm_core.engine_client.base import Command, EngineClient, LoopAccount, Result
from nanovllm_core.engine_client.step_loop import EngineProcess
from nanovllm_core.errors import ConfigError
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_data_parallel.router import Router

logger = logging.getLogger(__name__)

__all__ = ["DataParallelClient", "ReplicaPlacement", "combine_stats", "plan_replicas"]

STOP_TIMEOUT_S = 4.0  # how long join() waits for the replicas to leave before it kills the ones still there


# --- placement ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one replica runs: the environment its process starts with, and its torch CPU threads."""

    index: int
    env: dict[str, str]
    threads: int
    where: str  # for messages: "GPUs 2,3" or "CPU"


def plan_replicas(config: EngineConfig) -> list[ReplicaPlacement]:
    """One placement per replica. On CUDA, replica ``r`` gets GPUs ``r*tp .. (r+1)*tp - 1`` of those this process
    sees (its ``CUDA_VISIBLE_DEVICES`` entries when set); raises ConfigError when there are not enough."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    device = resolve_device(config.device)
    ports = _distinct_free_ports(dp) if tp > 1 else [None] * dp
    threads = max(1, (os.cpu_count() or 1) // dp)  # the replicas share the host's cores
    placements = []
    if device.type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if dp * tp > count:
            raise ConfigError(
                f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs; this process sees "
                f"{count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [s.strip() for s in visible.split(",") if s.strip()] if visible else [str(i) for i in range(count)]
        for r in range(dp):
            gpus = ",".join(ids[r * tp : (r + 1) * tp])
            env = {"CUDA_VISIBLE_DEVICES": gpus}
            if ports[r] is not None:
                env[PORT_ENV] = str(ports[r])
            placements.append(ReplicaPlacement(r, env, threads, f"GPU{'s' if tp > 1 else ''} {gpus}"))
        return placements
    for r in range(dp):
        env = {PORT_ENV: str(ports[r])} if ports[r] is not None else {}
        placements.append(ReplicaPlacement(r, env, threads, "CPU"))
    return placements


def _distinct_free_ports(n: int) -> list[int]:
    """``n`` ports free right now and distinct from each other (all bound at once while they are picked)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def build_replica_engine(env: dict[str, str], threads: int, config: EngineConfig) -> ModelEngineCore:
    """Runs in a replica's process (``EngineProcess(build=...)``): place it, then build its engine."""
    import torch

    os.environ.update(env)  # before anything starts CUDA in this process
    if "CUDA_VISIBLE_DEVICES" in env and torch.cuda.is_initialized():
        raise ConfigError(
            "CUDA was started in a data-parallel replica process before its GPUs were chosen: the main module, which "
            "every spawned process imports again, uses CUDA when imported. Move that code under "
            '`if __name__ == "__main__":`'
        )
    torch.set_num_threads(threads)
    # one engine here; the copy of a finished config is finished too: the replica resolves nothing again
    return ModelEngineCore(config=config.model_copy(update={"data_parallel_size": 1}))


def _refuse_while_bootstrapping() -> None:
    """A spawned process imports the main module before it runs anything; a script without the main guard then
    builds its data-parallel LLM again inside every replica. Say so instead of a bootstrapping traceback."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
    raise RuntimeError(
        f"a data-parallel replica process re-imported {main} and it built an LLM again: replicas are started with "
        "the 'spawn' method, which imports the main module in every replica. Put the code that builds the LLM "
        'under `if __name__ == "__main__":`'
    )


# --- stats --------------------------------------------------------------------------------------------------


def combine_stats(parts: list[Any]) -> Any:
    """One snapshot of several replicas (dataclasses of one type, as :class:`EngineStats`): numeric fields are
    summed, so queue lengths and counters add up, ``kv_cache_usage`` is over every replica's blocks and
    ``prefix_cache_hit_rate`` over every replica's queries; any other field must be equal in every part."""
    values = {}
    for field in dataclasses.fields(parts[0]):
        column = [getattr(p, field.name) for p in parts]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in column):
            values[field.name] = sum(column)
        elif all(v == column[0] for v in column):
            values[field.name] = column[0]
        else:
            raise TypeError(f"cannot combine {type(parts[0]).__name__}.{field.name} of the replicas: {column!r}")
    return type(parts[0])(**values)


# --- the core -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Owned:
    """A request in a replica, and the work it still has there (what routing balances)."""

    replica: int
    budget: int  # output tokens it may still produce: n * max_tokens
    remaining: int  # prompt (until its first output) + output tokens not produced yet
    kind: str  # its output_kind: what its outputs say about progress
    produced: int = 0
    args: tuple = ()  # the add's (prompt, params, request id): sent again if its replica dies before a token shows


@dataclass(slots=True)
class SentCommand:
    """A command sent to a replica that will be answered by one result, in the order sent."""

    kind: str
    request_id: str | None = None
    owned: _Owned | None = None  # an add: its record (new_owner: this add created it)
    new_owner: bool = False
    gather: _Gather | None = None
    command: Command | None = None  # what was sent (answered elsewhere if its replica dies first)


class _Gather:
    """A ``stats`` call sent to every replica: answered once all have answered."""

    def __init__(self, call_id: int | None, n: int, combine: bool) -> None:
        self.call_id = call_id
        self.parts: list[Any] = [None] * n
        self.left = n
        self.error: BaseException | None = None
        self.combine = combine

    def put(self, replica: int, result: Any, error: BaseException | None) -> bool:
        """One replica's answer (None and no error: a replica that is down); True once every replica answered."""
        self.parts[replica] = result
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        return self.left == 0

    def result(self) -> Result:
        if self.error is not None:
            return (self.call_id, None, self.error)
        if not self.combine:
            return (self.call_id, list(self.parts), None)
        present = [p for p in self.parts if p is not None]
        if not present:
            return (self.call_id, None, RuntimeError("no data-parallel replica is serving: every one is down"))
        return (self.call_id, combine_stats(present), None)


def _cost(args: tuple) -> tuple[int, int, str]:
    """(prompt tokens, output budget, output kind) of an ``add``'s arguments ``(prompt, params, request_id)``."""
    prompt, params = args[0], args[1] if len(args) > 1 else None
    if isinstance(prompt, str):
        prompt_tokens = len(prompt) // 4 + 1  # not tokenized here (the replica does it): about 4 characters a token
    else:
        prompt_tokens = len(prompt) if isinstance(prompt, (list, tuple)) else 1
    if isinstance(params, SamplingParams):
        return prompt_tokens, params.n * params.max_tokens, params.output_kind
    return prompt_tokens, SamplingParams.max_tokens, "final"


class DataParallelClient(EngineClient):
    """``data_parallel_size`` :class:`EngineProcess` replicas behind one client.

    Commands: ``add`` goes to the replica with the least outstanding work (prompt tokens not yet computed plus
    output tokens not yet produced, summed over its requests: what it still has to do; several adds submitted
    together are placed largest first) unless another replica holds its prompt's prefix (:attr:`router`), ``abort``
    to the replica that owns the request, ``stats`` to every replica (answered with :func:`combine_stats` of their
    answers; ``replica_stats`` answers the list), ``stop`` to all. Adds carry their request id (AsyncLLM's do): an
    add without one is not tracked, so it cannot be aborted through this client. Outputs pass through unchanged.
    ``emit`` is called from each replica's reader (one thread per replica, or the event loop with ``start(...,
    loop=loop)``); its account sums the replicas' accounts. When a replica fails or dies, ``fail`` is called once
    with an error naming it and the other replicas are stopped.
    """

    def __init__(self, config: EngineConfig) -> None:
        _refuse_while_bootstrapping()
        if launched_by_torchrun():
            raise ConfigError(
                "data_parallel_size > 1 starts its replicas itself and cannot run under torchrun; run the script "
                "with python (tensor_parallel_size still works within each replica)"
            )
        config = finish_config(config)  # (an entry point's is finished already: then this is a no-op)
        self.config: EngineConfig = config  # the replicas run this config, with data_parallel_size 1
        self.data_parallel_size = config.data_parallel_size
        self.placements = self._plan(config)
        self.replicas = self._start_replicas(config)
        n = self.data_parallel_size
        self._state_lock = threading.Lock()  # routing state; never held while sending
        self._send_locks = [threading.Lock() for _ in range(n)]  # one sender per replica: notes in send order
        self._notes: list[deque[SentCommand]] = [deque() for _ in range(n)]
        self._router = Router(n, self.config.kvcache_block_size)  # the prefix cache's granularity
        self._loads = self._router.loads  # the one list: kept here, read by the router
        self._up = [True] * n  # replicas that take requests (a Ray replica is down while it restarts)
        self._owners: dict[str, _Owned] = {}
        self._accounts = [LoopAccount() for _ in range(n)]
        self._stop_sent = [False] * n
        self._stopped = False
        self._joined = False
        self._failure: BaseException | None = None
        self._emit: Callable[..., None] | None = None
        self._fail: Callable[[BaseException], None] | None = None

    def _plan(self, config: EngineConfig) -> list[ReplicaPlacement]:
        return plan_replicas(config)

    def _start_replicas(self, config: EngineConfig) -> list[EngineProcess]:
        """Start every replica at once (each loads its weights and warms up in parallel); on any failure stop the
        ones that started and raise the first replica's error, naming the replica."""
        n = len(self.placements)
        replicas: list[EngineProcess | None] = [None] * n
        errors: list[BaseException | None] = [None] * n

        def build(p: ReplicaPlacement) -> None:
            try:
                make = functools.partial(build_replica_engine, p.env, p.threads, config)
                replicas[p.index] = EngineProcess(build=make)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                errors[p.index] = exc

        threads = [
            threading.Thread(target=build, args=(p,), name=f"nanovllm-dp-start-{p.index}", daemon=True)
            for p in self.placements
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        finally:
            failed = next((r for r, e in enumerate(errors) if e is not None), None)
            interrupted = any(t.is_alive() for t in threads)
            if failed is not None or interrupted:
                for t in threads:  # Ctrl-C while loading: the replicas that still load are stopped once ready
                    t.join()
                _stop_and_join([rep for rep in replicas if rep is not None], STOP_TIMEOUT_S)
        if failed is not None:
            exc = errors[failed]
            assert exc is not None
            where = self.placements[failed].where
            message = f"data-parallel replica {failed} ({where}) failed to start: {exc}"
            if isinstance(exc, RuntimeError) and "exited with status" in str(exc):
                message += " (its error output is above)"
            try:
                renamed = type(exc)(message)
            except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                renamed = RuntimeError(message)
            raise renamed from exc
        return [rep for rep in replicas if rep is not None]

    # --- push ----------------------------------------------------------------------------------------------

    def start(self, emit: Callable[..., None], fail: Callable[[BaseException], None], loop: Any = None) -> None:
        """Start delivering outputs: ``emit(results, outputs, now, account)`` and ``fail(exc)`` as for one
        replica, on ``loop`` when given."""
        self._emit, self._fail = emit, fail
        for r, replica in enumerate(self.replicas):
            replica.start(functools.partial(self._on_emit, r), functools.partial(self._on_fail, r), loop=loop)

    def submit(self, commands: list[Command]) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the data-parallel engine cannot take commands: {self._failure}")
        if self._stopped:
            raise RuntimeError("the data-parallel engine was stopped: it takes no more commands")
        n = len(self.replicas)
        batches: list[list[Command]] = [[] for _ in range(n)]
        notes: list[list[SentCommand]] = [[] for _ in range(n)]
        with self._state_lock:
            targets = self._place_adds(commands)
            for command, target in zip(commands, targets):
                call_id, kind, args = command
                if kind == "add":
                    r, note = target
                    batches[r].append(command)
                    notes[r].append(note)
                elif kind == "abort":
                    owned = self._owners.get(args[0]) if args else None
                    # unknown or finished: any replica says so
                    r = owned.replica if owned is not None else self._least_loaded()
                    batches[r].append(command)
                    notes[r].append(SentCommand("abort", command=command))
                elif kind in ("stats", "replica_stats"):
                    gather = _Gather(call_id, n, combine=kind == "stats")
                    for r in range(n):
                        if not self._up[r]:
                            gather.put(r, None, None)
                            continue
                        batches[r].append((call_id, "stats", ()))
                        notes[r].append(SentCommand("stats", gather=gather, command=(call_id, "stats", ())))
                elif kind == "stop":
                    self._stopped = True
                    for r in range(n):
                        if self._up[r]:
                            batches[r].append(command)
                else:  # one replica answers with the step loop's own error
                    r = self._least_loaded()
                    batches[r].append(command)
                    notes[r].append(SentCommand(kind, command=command))
        for r in range(n):
            if batches[r]:
                self._send(r, batches[r], notes[r])

    def _least_loaded(self) -> int:
        """The replica that takes requests with the least outstanding work (0 when none is up)."""
        return self._router.least_loaded(self._up)

    def _place_adds(self, commands: list[Command]) -> list[Any]:
        """For each command, ``(replica, note)`` if it is an add (else None); updates the owners and loads.

        A request id already owned (or repeated in the batch) goes to its owner, which rejects it as in use. New
        requests are placed largest first, each by the :class:`Router`: on the replica with the least outstanding
        work (a greedy longest-processing-time schedule: the batch's replicas end close together) unless another one
        holds its prompt's prefix and is not overloaded."""
        targets: list[Any] = [None] * len(commands)
        fresh: dict[str, int] = {}
        for i, (_, kind, args) in enumerate(commands):
            request_id = args[2] if kind == "add" and len(args) > 2 else None
            if isinstance(request_id, str) and request_id not in self._owners and request_id not in fresh:
                fresh[request_id] = i
        costs = {i: _cost(commands[i][2]) for i in fresh.values()}
        loads = self._loads
        for i in sorted(costs, key=lambda i: -(costs[i][0] + costs[i][1])):
            prompt_tokens, budget, kind = costs[i]
            args = commands[i][2]
            prompt, request_id = args[0], args[2]
            r = self._router.route(prompt, self._up)
            owned = _Owned(r, budget, prompt_tokens + budget, kind, args=args)
            loads[r] += owned.remaining
            self._owners[request_id] = owned
            targets[i] = (r, SentCommand("add", request_id, owned, new_owner=True, command=commands[i]))
        for i, (_, kind, args) in enumerate(commands):
            if kind == "add" and targets[i] is None:
                request_id = args[2] if len(args) > 2 else None
                owned = self._owners.get(request_id) if isinstance(request_id, str) else None
                if owned is None:  # no id (the replica rejects it): the least loaded replica says so
                    targets[i] = (self._least_loaded(), SentCommand("add", None, command=commands[i]))
                else:
                    prompt_tokens, budget, output_kind = _cost(args)
                    dup = _Owned(owned.replica, budget, prompt_tokens + budget, output_kind, args=args)
                    targets[i] = (owned.replica, SentCommand("add", request_id, dup, command=commands[i]))
        return targets

    def _send(self, r: int, batch: list[Command], notes: list[SentCommand]) -> None:
        with self._send_locks[r]:
            if self._stop_sent[r]:
                self._forget(notes)
                raise RuntimeError(f"data-parallel replica {r} was stopped")
            down = not self._up[r]  # it went down after the routing chose it
            if not down:
                self._notes[r].extend(notes)  # before the send: the answers may come back at once
                try:
                    self.replicas[r].submit(batch)
                except BaseException:  # nothing was sent (a command that does not pickle) or the replica is gone
                    for _ in notes:
                        self._notes[r].pop()
                    self._forget(notes)
                    raise
                if any(kind == "stop" for _, kind, _ in batch):
                    self._stop_sent[r] = True
        if down:
            self._replica_down(r, notes)

    def _replica_down(self, r: int, notes: list[SentCommand]) -> None:
        """Commands routed to replica ``r`` before it went down (not here: a replica that dies stops them all)."""
        self._forget(notes)
        raise RuntimeError(f"data-parallel replica {r} is down")

    def _forget(self, notes: list[SentCommand]) -> None:
        """Undo the routing of adds that were not sent."""
        with self._state_lock:
            for note in notes:
                if note.new_owner and note.owned is not None and self._owners.get(note.request_id) is note.owned:
                    del self._owners[note.request_id]
                    self._loads[note.owned.replica] -= note.owned.remaining

    def _on_emit(self, r: int, results: list[Result], outputs: list[RequestOutput], now: float, account: Any) -> None:
        forward: list[Result] = []
        answered: list[_Gather] = []
        with self._state_lock:
            self._accounts[r] = account
            notes = self._notes[r]
            for result in results:
                note = notes.popleft()
                if note.kind == "stats":
                    assert note.gather is not None
                    if note.gather.put(r, result[1], result[2]):
                        answered.append(note.gather)
                    continue
                if note.kind == "add" and note.owned is not None:
                    self._settle_add(note, failed=result[2] is not None)
                forward.append(result)
            owners, loads = self._owners, self._loads
            for out in outputs:
                owned = owners.get(out.request_id)
                if owned is None:
                    continue
                if out.finished:
                    del owners[out.request_id]
                    loads[owned.replica] -= owned.remaining
                    continue
                new = sum(len(c.token_ids) for c in out.outputs)
                owned.produced = owned.produced + new if owned.kind == "delta" else new
                remaining = max(owned.budget - owned.produced, 0)  # its prompt is computed: it produced tokens
                loads[owned.replica] += remaining - owned.remaining
                owned.remaining = remaining
            total = LoopAccount.combined(self._accounts)
        forward.extend(g.result() for g in answered)
        if (forward or outputs) and self._emit is not None:
            self._emit(forward, outputs, now, total)

    def _settle_add(self, note: SentCommand, failed: bool) -> None:
        """An add's result: a rejected new request leaves its replica's load; a repeated id that was accepted
        (its first add was rejected) becomes the owner."""
        owned, request_id = note.owned, note.request_id
        assert owned is not None and request_id is not None
        if failed and note.new_owner:
            if self._owners.get(request_id) is owned:
                del self._owners[request_id]
                self._loads[owned.replica] -= owned.remaining
        elif not failed and not note.new_owner and request_id not in self._owners:
            self._owners[request_id] = owned
            self._loads[owned.replica] += owned.remaining

    def _on_fail(self, r: int, exc: BaseException) -> None:
        with self._state_lock:
            if self._failure is not None:
                return
            where = self.placements[r].where
            self._failure = RuntimeError(f"data-parallel replica {r} ({where}) failed: {exc}")
            self._failure.__cause__ = exc
            failure = self._failure
            stopping = self._stopped
        if self._fail is not None:
            self._fail(failure)
        if stopping:  # the others were told already
            return
        logger.error("%s; stopping the other replicas", failure)
        # the others are told from a thread of their own: this one may be the event loop, or a reader
        threading.Thread(target=self._send_stop, name="nanovllm-dp-stop", daemon=True).start()

    def _send_stop(self) -> None:
        """Tell every replica that was not told yet to stop (a dead one cannot be told: skipped)."""
        for r, replica in enumerate(self.replicas):
            with self._send_locks[r]:
                if self._stop_sent[r]:
                    continue
                self._stop_sent[r] = True
                try:
                    replica.submit([(None, "stop", ())])
                except (OSError, ValueError):  # its pipe is gone (dead, or closed at interpreter exit)
                    pass

    def join(self) -> None:
        """Wait for every replica to end (the ones not told to stop yet are told now); a replica still there
        after STOP_TIMEOUT_S seconds is killed."""
        if self._joined:
            return
        self._stopped = True
        self._send_stop()
        _stop_and_join(self.replicas, STOP_TIMEOUT_S, told=True)
        self._joined = True

    def close(self) -> None:
        """Stop and join every replica (idempotent; what shutdown() and the garbage collector do)."""
        self.join()

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own stats, in replica order (:meth:`stats` combines them)."""
        return self._pull().call("replica_stats", ())

    @property
    def replica_processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The replicas' processes (replica r at index r)."""
        return [replica.process for replica in self.replicas]

    @property
    def alive(self) -> bool:
        """Some replica's process still runs."""
        return any(replica.alive for replica in self.replicas)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped serving (a replica failed or died), or None."""
        return self._failure

    @property
    def router(self) -> Router:
        """What places new requests (its ``policy`` may be changed between calls)."""
        return self._router

    @property
    def loads(self) -> list[int]:
        """Each replica's outstanding work in tokens, as routing sees it."""
        with self._state_lock:
            return list(self._loads)


def _stop_and_join(replicas: list[EngineProcess], timeout: float, told: bool = False) -> None:
    """Stop (unless ``told``) and join replicas; kill the ones still running after ``timeout`` seconds."""
    if not told:
        for replica in replicas:
            try:
                replica.submit([(None, "stop", ())])
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + timeout
    for replica in replicas:
        replica.process.join(max(0.0, deadline - time.monotonic()))
    for replica in replicas:
        if replica.process.is_alive():
            logger.warning("data-parallel replica process %s did not stop in time; killing it", replica.process.pid)
            replica.process.kill()
    for replica in replicas:
        replica.join()
