"""Tensor parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs).

Rank 0 runs the engine (scheduler, sampling) and its shard of the model; ranks 1..N-1 are workers that
build the same shard layout and KV cache and run every step on rank 0's decision. Each step rank 0
broadcasts the step's flattened inputs (:class:`HostBatch`) over a gloo control group; all ranks then run
the forward together (the all-reduces and the logits all-gather inside the layers keep them in step).

Started two ways:
- ``LLM(..., tensor_parallel_size=N)`` on one host spawns N-1 worker processes itself;
- under ``torchrun`` (``RANK``/``WORLD_SIZE`` set, ``env://`` rendezvous) every process runs the same
  script: rank 0 returns an engine, the other ranks serve as workers inside the ``LLM`` constructor and
  exit the process when rank 0 shuts down.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm_core.distributed import set_tensor_parallel

INIT_TIMEOUT = timedelta(seconds=int(os.environ.get("NANOVLLM_TP_TIMEOUT", "300")))


@dataclass
class RunnerSpec:
    """Everything a rank needs to build its model runner; plain data, so it pickles to a spawned worker."""

    config: dict[str, Any]
    architecture: str
    attention: str
    device_type: str
    dtype: str


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def local_device(device_type: str, rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank)


def init_distributed(rank: int, world_size: int, init_method: str, device_type: str) -> dist.ProcessGroup:
    """Join the process group; returns the gloo group used for control messages."""
    device = local_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=INIT_TIMEOUT)
    set_tensor_parallel(rank, world_size)
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def build_runner(spec: RunnerSpec, rank: int):
    """Build this rank's runner from its own plugin registry (every process loads the plugins itself)."""
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.model_runner import ModelRunner
    from nanovllm_core.loader import load_hf_config
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    config = EngineConfig(**spec.config)
    hf_config = load_hf_config(config.model)
    model_cls = registry.get("model", spec.architecture).obj
    backend_cls = registry.get("attention", spec.attention).obj
    return ModelRunner(
        config, hf_config, model_cls, backend_cls, local_device(spec.device_type, rank), getattr(torch, spec.dtype)
    )


def serve(runner, control: dist.ProcessGroup) -> None:
    """A worker's loop: run every step rank 0 announces, until it says ``exit``."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        kind, payload = message[0]
        if kind == "step":
            runner.run_step(payload)
        elif kind == "exit":
            dist.barrier(group=control)  # leave together: no rank tears down a connection another still uses
            return


def worker_main(rank: int, world_size: int, init_method: str, spec: RunnerSpec) -> None:
    if spec.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    control = init_distributed(rank, world_size, init_method, spec.device_type)
    try:
        serve(build_runner(spec, rank), control)
    except KeyboardInterrupt:
        pass
    finally:
        dist.destroy_process_group()


def _within(fn: Any, seconds: float) -> bool:
    """Run ``fn`` with a deadline (in a daemon thread: a collective whose peers are gone must not keep the
    process from exiting); True if it finished without an error. At interpreter exit, where Python 3.12 starts no
    new thread (``weakref.finalize`` runs then), it runs in this thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as False; the caller falls back
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # interpreter shutdown
        run()
        return not errors
    thread.join(timeout=seconds)
    return not thread.is_alive() and not errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's side: starts (or joins) the workers and tells them what to run."""

    def __init__(self, spec: RunnerSpec, world_size: int) -> None:
        self.world_size = world_size
        self.processes: list[mp.Process] = []
        self.closed = False
        if launched_by_torchrun():
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, world_size):
                proc = ctx.Process(target=worker_main, args=(rank, world_size, init_method, spec), daemon=True)
                proc.start()
                self.processes.append(proc)
        if spec.device_type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.control = init_distributed(0, world_size, init_method, spec.device_type)

    def check_workers(self) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        if dead:
            self.close(graceful=False)
            detail = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
            raise RuntimeError(f"tensor-parallel worker died: {detail}; the engine cannot continue")

    def send(self, kind: str, payload: Any = None) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel group is shut down")
        self.check_workers()
        dist.broadcast_object_list([(kind, payload)], src=0, group=self.control)

    def _say_exit(self) -> None:
        dist.broadcast_object_list([("exit", None)], src=0, group=self.control)
        dist.barrier(group=self.control)

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and all(p.is_alive() for p in self.processes) and _within(self._say_exit, 10):
            # Every rank is leaving now: tear the groups down together, before waiting for the workers to
            # exit. NCCL's teardown can wait for its peers, so a rank 0 that joined the workers first (while they
            # sat in their own teardown) and destroyed its group after they were gone would wait forever.
            _within(dist.destroy_process_group, 60)
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        if dist.is_initialized():  # the farewell failed (a peer gone or out of step): best effort, bounded
            _within(dist.destroy_process_group, 10)
        set_tensor_parallel(0, 1)
