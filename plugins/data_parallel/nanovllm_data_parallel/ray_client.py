"""Data parallelism on Ray (``data_parallel_backend = "ray"``): each replica an engine in a Ray actor, anywhere in
the cluster, behind :class:`RayDataParallelClient`, the data-parallel client with Ray actors for replicas.

Routing, request ownership, stats and the pull surface are :class:`DataParallelClient`'s. What Ray changes:

- **Placement.** One placement-group bundle per replica (``SPREAD`` over the nodes; ``PACK`` when replicas share
  GPUs), each ``{"CPU": 1, "GPU": g}`` with ``g`` = ``ray_num_gpus_per_replica`` (default ``tensor_parallel_size``)
  where the engines run on CUDA. A bundle lives on one node, so a replica's tensor-parallel ranks do too.
  Replicas that share a GPU (``g`` < 1) start one after another, each taking ``g x gpu_memory_utilization`` of the
  GPU on top of what is in use when it starts.
- **Faults.** A replica whose actor dies (its process killed, its node gone) is taken out of the routing. Its
  requests that have shown no token yet (every ``LLM.generate`` request: they return whole; a stream before its
  first token) go to another replica; the others finish with an error naming the replica. Ray restarts the actor
  (``ray_max_restarts``); once its engine is built again it rejoins the routing with an empty cache. Only when
  every replica is gone for good does the client fail.
- **Shutdown** stops the engines, kills the actors, removes the placement group and, if this client started the Ray
  runtime (no cluster was joined before), shuts it down.

The actor runs the engine's step loop in a thread (an :class:`~nanovllm_core.engine_client.step_loop.InProcessClient`);
the client reads its outputs with one long-polling reader thread per replica. Commands carry a sequence number and
the actor's incarnation: the actor takes them in order, and a restarted actor drops what was meant for the one
before it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.config_resolver import resolve_device
from nanovllm_core.engine_client.base import Command, LoopAccount, Result
from nanovllm_core.engine_client.step_loop import InProcessClient, on_loop, pack_outputs, unpack_outputs
from nanovllm_core.errors import ConfigError
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_data_parallel.client import (
    STOP_TIMEOUT_S,
    DataParallelClient,
    ReplicaPlacement,
    SentCommand,
    build_replica_engine,
)

logger = logging.getLogger(__name__)

__all__ = ["RayDataParallelClient", "ReplicaActor", "import_ray"]

POLL_S = 1.0  # how long one poll of a replica's outputs waits in the actor
PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster may take to reserve the replicas' resources
RESTART_TIMEOUT_S = 600.0  # how long a dead replica may take to come back before it counts as gone


def import_ray() -> Any:
    """The ``ray`` module, or a one-line ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "data_parallel_backend='ray' needs the ray package, which is not installed: "
            "pip install \"nanovllm-data-parallel[ray]\" (or use data_parallel_backend='mp', one host)"
        ) from None
    return ray


# --- the replica: an actor holding one engine ---------------------------------------------------------------


def _gpu_share(config: EngineConfig, fraction: float) -> EngineConfig:
    """A replica sharing its GPU takes ``fraction`` of ``gpu_memory_utilization`` on top of what is in use."""
    import torch

    free, total = torch.cuda.mem_get_info()
    used = (total - free) / total
    share = min(1.0, used + config.gpu_memory_utilization * fraction)
    return config.model_copy(update={"gpu_memory_utilization": share})


class ReplicaActor:
    """One engine in a Ray actor: an :class:`InProcessClient` running its step loop in a thread, and the outputs kept
    for the client's polls (a threaded actor: ``submit`` and ``poll`` run beside the loop)."""

    def __init__(self, config: EngineConfig, gpu_fraction: float | None = None) -> None:
        if gpu_fraction is not None and gpu_fraction < 1 and resolve_device(config.device).type == "cuda":
            config = _gpu_share(config, gpu_fraction)
        self.incarnation = uuid.uuid4().hex
        self.start_error: BaseException | None = None  # raised by ready(): Ray reports it with its type and text
        try:
            # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs; on CPU its one reserved core gets one torch thread
            self.client = InProcessClient(build_replica_engine({}, 1, config))
        except Exception as exc:  # noqa: BLE001
            self.start_error = exc
            return
        self._cond = threading.Condition()
        self._early: dict[int, list[Command]] = {}  # batches that arrived before one sent earlier
        self._next_seq = 0
        self._stopping = False
        self._closed = False
        self._messages: list[tuple] = []
        self.client.start(self._emit, lambda exc: self._put(("failed", exc)))

    def ready(self) -> tuple[str, EngineConfig, int, str, list[str]]:
        """(incarnation, the engine's resolved config, process id, node IP, GPU ids); raises the engine's error if
        it could not be built."""
        import ray

        if self.start_error is not None:
            raise self.start_error
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return self.incarnation, self.client.config, os.getpid(), ray.util.get_node_ip_address(), gpus

    def submit(self, incarnation: str, seq: int, commands: list[Command]) -> None:
        if incarnation != self.incarnation:  # meant for the actor before a restart: its requests went elsewhere
            return
        with self._cond:
            self._early[seq] = commands
            while self._next_seq in self._early:
                batch = self._early.pop(self._next_seq)
                self._next_seq += 1
                self._stopping = self._stopping or any(kind == "stop" for _, kind, _ in batch)
                self.client.submit(batch)

    def poll(self, timeout: float) -> list[tuple]:
        """The loop's messages since the last poll, waiting up to ``timeout`` seconds for one; ``("closed",)`` once
        the loop has ended (after a ``stop``) and everything was handed over."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._messages and (self.client.alive or self._closed) and time.monotonic() < deadline:
                # after a stop the loop ends without a word: look again soon
                self._cond.wait(0.02 if self._stopping and not self._closed else deadline - time.monotonic())
            messages, self._messages = self._messages, []
            if messages or self.client.alive or self._closed:
                return messages
            self._closed = True
        self.client.join()  # the loop's thread, then the engine's shutdown
        return [("closed",)]

    def _put(self, message: tuple) -> None:
        with self._cond:
            self._messages.append(message)
            self._cond.notify_all()

    def _emit(self, results: list[Result], outputs: list[RequestOutput], now: float, account: LoopAccount) -> None:
        snapshot = dataclasses.replace(account, slow_steps=list(account.slow_steps))
        self._put(("out", results, pack_outputs(outputs), now, snapshot))


class RayReplica:
    """The client's side of one replica actor: commands in order to its current incarnation, and a reader thread
    that hands its outputs over and follows it through restarts."""

    def __init__(self, index: int, actor: Any) -> None:
        self.index = index
        self.actor = actor
        self.incarnation = ""
        self.config: EngineConfig | None = None
        self.pid = 0
        self.where = "Ray actor"
        self._seq = 0
        self._stopping = False
        self.gone = False  # dead for good (no restart left)
        self.killed = False  # by the client's shutdown
        self.ended = threading.Event()  # its reader stopped

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the actor's engine (built in its constructor), and talk to this incarnation from now on."""
        import ray

        incarnation, config, pid, ip, gpus = ray.get(self.actor.ready.remote(), timeout=timeout)
        self.incarnation, self.config, self.pid, self._seq = incarnation, config, pid, 0
        on_gpus = f", GPU{'s' if len(gpus) > 1 else ''} {','.join(gpus)}" if gpus else ""
        self.where = f"Ray actor on node {ip}{on_gpus}"

    def submit(self, commands: list[Command]) -> None:
        """Send commands (the caller holds this replica's send lock: sequence numbers go out in order)."""
        if any(kind == "stop" for _, kind, _ in commands):
            self._stopping = True
        self.actor.submit.remote(self.incarnation, self._seq, commands)
        self._seq += 1

    def start(
        self, emit: Callable[..., None], died: Callable[[BaseException], None], rejoined: Callable[[], None],
        gone: Callable[[BaseException], None], loop: Any = None,
    ) -> None:  # fmt: skip
        if loop is not None:
            emit, died, rejoined, gone = (on_loop(loop, f) for f in (emit, died, rejoined, gone))
        threading.Thread(
            target=self._read, args=(emit, died, rejoined, gone), name=f"nanovllm-ray-reader-{self.index}", daemon=True
        ).start()

    def _read(self, emit: Callable[..., None], died: Callable, rejoined: Callable, gone: Callable) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        failure: BaseException | None = None  # the step loop's own error: the actor is restarted for it
        try:
            while not self.killed:
                try:
                    messages = ray.get(self.actor.poll.remote(POLL_S))
                except (RayActorError, ActorUnavailableError) as exc:
                    if self._stopping:
                        return
                    died(failure or exc)
                    failure = None
                    if not self._await_restart(gone):
                        return
                    rejoined()
                    continue
                for message in messages:
                    if message[0] == "out":
                        _, results, rows, now, account = message
                        emit(results, unpack_outputs(rows), now, account)
                    elif message[0] == "failed":
                        failure = message[1]
                        ray.kill(self.actor, no_restart=False)  # a fresh engine: Ray restarts the actor
                    elif message[0] == "closed" and self._stopping:
                        return
        except Exception:
            if not (self._stopping or self.killed):  # after shutdown Ray's calls fail: nothing is left to read
                raise
        finally:
            self.ended.set()

    def _await_restart(self, gone: Callable[[BaseException], None]) -> bool:
        """Wait for Ray to restart the actor; False (after calling ``gone``) when it will not come back."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not self._stopping:
            try:
                self.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
                return True
            except ActorUnavailableError:  # not reachable yet
                time.sleep(0.2)
            except (ActorDiedError, GetTimeoutError, RayTaskError) as exc:  # RayTaskError: its engine failed to build
                self.gone = True
                ray.kill(self.actor, no_restart=True)
                gone(exc)
                return False
        return False

    @property
    def alive(self) -> bool:
        return not (self.gone or self.killed or self.ended.is_set())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _cause(exc: BaseException) -> str:
    """Why a replica died or failed to start, in one line: the exception its engine raised, else Ray's first
    sentence about the actor (its process died, its node is gone)."""
    inner = exc
    while getattr(inner, "cause", None) is not None and inner.cause is not inner:
        inner = inner.cause
    if inner is exc and type(exc).__module__.startswith("ray."):
        return f"its Ray actor is gone ({type(exc).__name__}: {_first_line(exc).split('. ')[0]})"
    return f"{type(inner).__name__}: {_first_line(inner)}"


# --- the client ---------------------------------------------------------------------------------------------


class RayDataParallelClient(DataParallelClient):
    """``data_parallel_size`` replicas as Ray actors (see the module's text), behind one client.

    Joins the cluster at ``ray_address`` (``ray.init(address=...)``), or starts a local Ray runtime when there is
    none and no Ray connection exists in this process yet (an existing one is used as it is)."""

    finishes_config_on_replicas = True  # each actor finishes the config on its node: the front-end may have no GPU

    def __init__(self, config: EngineConfig) -> None:
        self._ray = import_ray()
        self._started_ray = False
        self._placement_group: Any = None
        self._gone = [False] * config.data_parallel_size
        super().__init__(config)
        # the replicas finished the config on the cluster's nodes (finish_config leaves it to them): the front-end's
        # is the first replica's, which every replica shares but for a GPU share's memory fraction
        self.config = self.replicas[0].config.model_copy(update={"data_parallel_size": self.data_parallel_size})

    # --- start-up --------------------------------------------------------------------------------------------

    def _plan(self, config: EngineConfig) -> list[ReplicaPlacement]:
        ray = self._ray
        if not ray.is_initialized():
            try:
                ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                where = f"the Ray cluster at ray_address={config.ray_address!r}" if config.ray_address else "Ray"
                raise ConfigError(f"cannot start or join {where}: {_first_line(exc)}") from None
            self._started_ray = True
        elif config.ray_address is not None:
            logger.info("Ray is connected already in this process: ray_address=%s is not used", config.ray_address)
        device = config.device
        on_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        self._gpus = (config.ray_num_gpus_per_replica or config.tensor_parallel_size) if on_gpu else 0.0
        self._sharing = 0 < self._gpus < 1
        bundle: dict[str, float] = {"CPU": 1}
        if self._gpus:
            bundle["GPU"] = self._gpus
        from ray.util.placement_group import placement_group, remove_placement_group

        n = config.data_parallel_size
        pg = placement_group([dict(bundle)] * n, strategy="PACK" if self._sharing else "SPREAD")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as exc:
            remove_placement_group(pg)
            self._release_ray()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise ConfigError(
                    f"the Ray cluster cannot place {n} data-parallel replicas of {bundle} each within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.cluster_resources()}"
                ) from None
            raise
        self._placement_group = pg
        return [ReplicaPlacement(r, {}, 1, "Ray actor") for r in range(n)]

    def _start_replicas(self, config: EngineConfig) -> list[RayReplica]:  # type: ignore[override]
        """Start the actors (all at once; one after another when they share GPUs) and wait for their engines; on any
        failure kill them, release the cluster and raise the first replica's error, naming the replica."""
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(ReplicaActor)
        replicas: list[RayReplica] = []
        try:
            for r in range(config.data_parallel_size):
                options: dict[str, Any] = dict(
                    num_cpus=1, num_gpus=self._gpus, max_restarts=config.ray_max_restarts, max_task_retries=0,
                    max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._placement_group, placement_group_bundle_index=r),
                )  # fmt: skip
                actor = actor_class.options(**options).remote(config, self._gpus if self._sharing else None)
                replicas.append(RayReplica(r, actor))
                if self._sharing:
                    self._wait_started(replicas[-1])
            for replica in replicas:
                if replica.config is None:
                    self._wait_started(replica)
        except BaseException:
            for replica in replicas:
                ray.kill(replica.actor, no_restart=True)
            self._release_ray()
            raise
        self.placements = [ReplicaPlacement(r.index, {}, 1, r.where) for r in replicas]
        return replicas

    @staticmethod
    def _wait_started(replica: RayReplica) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            replica.wait_ready()
        except (RayActorError, RayTaskError) as exc:
            cause = getattr(exc, "cause", None)
            message = f"data-parallel replica {replica.index} (Ray actor) failed to start: {_cause(exc)}"
            try:  # the engine's own error type (a ConfigError stays one)
                renamed = type(cause)(message) if isinstance(cause, Exception) else RuntimeError(message)
            except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                renamed = RuntimeError(message)
            raise renamed from exc

    # --- push ------------------------------------------------------------------------------------------------

    def start(self, emit: Callable[..., None], fail: Callable[[BaseException], None], loop: Any = None) -> None:
        self._emit, self._fail = emit, fail
        for r, replica in enumerate(self.replicas):
            replica.start(
                functools.partial(self._on_emit, r), functools.partial(self._replica_died, r),
                functools.partial(self._replica_rejoined, r), functools.partial(self._on_fail, r), loop=loop,
            )  # fmt: skip

    def _replica_down(self, r: int, notes: list[SentCommand]) -> None:
        self._reroute(r, [(note.command, note) for note in notes], f"data-parallel replica {r} is down")

    # --- faults ----------------------------------------------------------------------------------------------

    def _replica_died(self, r: int, exc: BaseException) -> None:
        """Take replica ``r`` out of the routing: its unanswered commands and its requests go elsewhere, or fail
        (a request that has shown tokens, or when no other replica serves) with an error naming it."""
        error = f"data-parallel replica {r} ({self.placements[r].where}) died: {_cause(exc)}"
        with self._send_locks[r], self._state_lock:
            if not self._up[r]:
                return
            self._up[r] = False
            self._router.forget(r)
            pending = list(self._notes[r])
            self._notes[r].clear()
            mine = [(rid, o) for rid, o in self._owners.items() if o.replica == r]
        logger.error("%s; %d requests in flight there", error, len(mine))
        waiting = {n.request_id for n in pending if n.kind == "add"}
        orphans: list[tuple[Command | None, SentCommand]] = [(n.command, n) for n in pending]
        # requests accepted there: the ones that have shown no token yet are added again elsewhere
        orphans += [
            ((None, "add", o.args), SentCommand("add", rid, o, new_owner=True)) for rid, o in mine if rid not in waiting
        ]
        # requests the caller let go (an abort of some samples only leaves the request running)
        aborted = {
            args[0] for n in pending if n.kind == "abort" and n.command is not None and (args := n.command[2])
            and (len(args) < 2 or args[1] is None)
        }  # fmt: skip
        self._reroute(r, orphans, error, aborted)

    def _reroute(
        self, r: int, orphans: list[tuple[Command | None, SentCommand]], error: str,
        aborted: frozenset | set = frozenset(),
    ) -> None:  # fmt: skip
        """Commands meant for the down replica ``r``: adds of requests without a token shown go to another replica,
        the other requests finish with ``error`` (those being ``aborted`` as aborted); aborts are answered, stats
        skip the replica, anything else is answered with ``error``."""
        results: list[Result] = []
        outputs: list[RequestOutput] = []
        resend: list[Command] = []
        with self._state_lock:
            others = any(self._up) and not self._stopped
            for command, note in orphans:
                if note.kind == "stats":
                    assert note.gather is not None
                    if note.gather.put(r, None, None):
                        results.append(note.gather.result())
                    continue
                assert command is not None
                if note.kind == "add" and note.owned is not None and self._owners.get(note.request_id) is note.owned:
                    del self._owners[note.request_id]
                    self._loads[note.owned.replica] -= note.owned.remaining
                    if note.request_id in aborted:  # the caller let it go: it ends here, as an abort would
                        outputs.append(_failed_output(note.request_id, note.owned.args, None))
                        continue
                    if others and note.owned.produced == 0:
                        resend.append(command)
                        continue
                    if command[0] is not None:
                        results.append((command[0], None, None))  # accepted, and failed with its output
                    outputs.append(_failed_output(note.request_id, note.owned.args, error))
                elif note.kind == "add" and others:
                    resend.append(command)  # no id, or a repeated one: another replica answers it
                else:
                    exc = None if note.kind == "abort" else RuntimeError(error)
                    results.append((command[0], None, exc))
        if resend:
            try:
                self.submit(resend)
            except RuntimeError as exc:  # stopped meanwhile, or every replica went down
                for call_id, _, args in resend:
                    if call_id is not None:
                        results.append((call_id, None, None))
                    outputs.append(_failed_output(args[2], args, f"{error}; {exc}"))
        if (results or outputs) and self._emit is not None:
            with self._state_lock:
                total = LoopAccount.combined(self._accounts)
            self._emit(results, outputs, time.monotonic(), total)

    def _replica_rejoined(self, r: int) -> None:
        with self._state_lock:
            if self._stopped:
                return
            self._router.forget(r)
            self._loads[r] = 0
            self._accounts[r] = LoopAccount()
            self._up[r] = True
            self.placements[r] = ReplicaPlacement(r, {}, 1, self.replicas[r].where)
        logger.warning("data-parallel replica %d (%s) restarted and serves again", r, self.replicas[r].where)

    def _on_fail(self, r: int, exc: BaseException) -> None:
        """Replica ``r`` is gone for good (no restart left); the client fails only when every replica is."""
        self._replica_died(r, exc)
        with self._state_lock:
            self._gone[r] = True
            if not all(self._gone) or self._failure is not None or self._stopped:
                return
            self._failure = RuntimeError(f"every data-parallel replica is gone (the last: replica {r}: {_cause(exc)})")
            failure = self._failure
        if self._fail is not None:
            self._fail(failure)

    # --- shutdown ----------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Stop the engines (waiting up to STOP_TIMEOUT_S for them), kill the actors, remove the placement group and
        shut the Ray runtime down if this client started it."""
        if self._joined:
            return
        self._stopped = True
        self._send_stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in self.replicas:
            replica._stopping = True
            if self._emit is not None and not replica.gone:  # a reader runs: it sees the engine close
                replica.ended.wait(max(0.0, deadline - time.monotonic()))
        for replica in self.replicas:
            replica.killed = True
            self._ray.kill(replica.actor, no_restart=True)
        for replica in self.replicas:  # a reader waiting on the actor sees it die
            replica.ended.wait(max(0.0, deadline + 1.0 - time.monotonic()))
        self._release_ray()
        self._joined = True

    def _release_ray(self) -> None:
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False

    # --- what tests and tools look at ---------------------------------------------------------------------------

    @property
    def replica_processes(self) -> list[Any]:  # type: ignore[override]
        raise AttributeError("Ray replicas run in actors: see replica_pids and replica_actors")

    @property
    def replica_pids(self) -> list[int]:
        """Each replica actor's current process id (on its node)."""
        return [replica.pid for replica in self.replicas]

    @property
    def replica_actors(self) -> list[Any]:
        return [replica.actor for replica in self.replicas]

    @property
    def replicas_up(self) -> list[bool]:
        """Which replicas take requests now (a restarting one does not)."""
        with self._state_lock:
            return list(self._up)


def _failed_output(request_id: str | None, args: tuple, error: str | None) -> RequestOutput:
    """The final output of a request its dead replica took with it: failed with ``error``, or aborted (None)."""
    params = args[1] if len(args) > 1 else None
    n = params.n if isinstance(params, SamplingParams) else 1
    reason = "error" if error is not None else "abort"
    return RequestOutput(
        request_id=request_id or "",
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(i, "", [], reason) for i in range(n)],
        finished=True,
        error=error,
    )
