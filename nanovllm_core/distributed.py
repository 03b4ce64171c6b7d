"""Tensor-parallel state of this process. With one rank every collective is a no-op.

All-reduce goes through NCCL (gloo on CPU) unless PyTorch symmetric memory is switched on for small messages
(:func:`setup_symm_mem_all_reduce`, off by default): two environment variables, read by every rank when it
joins the group, give the largest message in bytes that takes each symmetric-memory algorithm:

- ``NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES``: messages up to this size use the one-shot all-reduce (each rank
  reads every peer's copy over NVLink and sums it: one kernel, lowest latency for small messages);
- ``NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES``: larger messages up to this size use the two-shot all-reduce
  (reduce-scatter then all-gather through peer memory; world sizes 2, 4 and 8 only);
- anything larger, any other dtype than bfloat16 / float32, any other op than a sum: NCCL.

``benchmarks/allreduce.py`` measures the three against message size and prints the settings its figures
support. NVLink multicast is never used (``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set to 1 when unset). The
symmetric-memory kernels wait for their peers by spinning on the GPU: a rank that dies mid-step leaves its
peers' GPUs spinning until their processes end (NCCL's abort does not reach them).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm_core.errors import ConfigError

ONE_SHOT_ENV = "NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES"
TWO_SHOT_ENV = "NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES"
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # what PyTorch's one-/two-shot kernels reduce
_ALIGN = 16  # bytes: the kernels' widest vector; messages and their offsets must be multiples of it

_tp_rank = 0
_tp_size = 1
_peer_failure_check: Callable[[], None] | None = None


@dataclass(frozen=True)
class SymmMemLimits:
    """Largest message (bytes) for each symmetric-memory algorithm; 0 turns one off."""

    one_shot_max_bytes: int = 0
    two_shot_max_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.one_shot_max_bytes > 0 or self.two_shot_max_bytes > 0

    @property
    def buffer_bytes(self) -> int:
        largest = max(self.one_shot_max_bytes, self.two_shot_max_bytes)
        return -(-largest // _ALIGN) * _ALIGN

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SymmMemLimits:
        env = os.environ if environ is None else environ
        values = []
        for name in (ONE_SHOT_ENV, TWO_SHOT_ENV):
            text = env.get(name, "").strip() or "0"
            try:
                value = int(text)
            except ValueError:
                value = -1
            if value < 0:
                raise ConfigError(f"{name}={text!r}: give a message size in bytes, an integer >= 0 (0: off)")
            values.append(value)
        return cls(*values)

    def method(self, nbytes: int, dtype: torch.dtype, aligned: bool = True) -> str:
        """Which all-reduce a sum of ``nbytes`` of ``dtype`` takes: ``"one_shot"``, ``"two_shot"`` or ``"nccl"``
        (``aligned``: the tensor's offset and size are multiples of 16 bytes, as the kernels need)."""
        if nbytes == 0 or dtype not in SYMM_MEM_DTYPES or not aligned or nbytes % _ALIGN:
            return "nccl"
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= self.two_shot_max_bytes:
            return "two_shot"
        return "nccl"


class SymmMemAllReduce:
    """In-place sums through one symmetric buffer (every rank's copy mapped into every peer's address space).

    The message is copied into the buffer and reduced from it; the kernels start and end with a barrier over
    the ranks, so the next all-reduce cannot overwrite a buffer a peer still reads. Capturable in CUDA graphs
    (fixed buffer addresses), provided the buffer exists before the capture.
    """

    def __init__(self, limits: SymmMemLimits, device: torch.device, group: dist.ProcessGroup) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size(group)
        if limits.two_shot_max_bytes > 0 and world not in (2, 4, 8):
            raise ConfigError(
                f"{TWO_SHOT_ENV} is set but PyTorch's two-shot all-reduce runs on 2, 4 or 8 ranks, not {world}: "
                f"set it to 0 (NCCL) or use {ONE_SHOT_ENV} only"
            )
        self.limits = limits
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a deprecated no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(limits.buffer_bytes, dtype=torch.uint8, device=device)
        self.buffer.zero_()
        torch.cuda.synchronize(device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)  # copies in its own kernel
        self._one_shot = ops.one_shot_all_reduce_out
        self._two_shot = ops.two_shot_all_reduce_out

    def method(self, x: torch.Tensor) -> str:
        size = x.element_size()
        aligned = x.is_cuda and x.is_contiguous() and (x.storage_offset() * size) % _ALIGN == 0
        return self.limits.method(x.numel() * size, x.dtype, aligned)

    def __call__(self, x: torch.Tensor, method: str) -> None:
        """Sum ``x`` over the ranks in place with ``method`` (``"one_shot"`` or ``"two_shot"``)."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        if method == "one_shot" and self._one_shot_copy is not None:
            self._one_shot_copy(staged, flat, "sum", self.group_name, flat)
            return
        staged.copy_(flat)
        (self._one_shot if method == "one_shot" else self._two_shot)(staged, "sum", self.group_name, flat)


_symm_mem: SymmMemAllReduce | None = None


def set_tensor_parallel(rank: int, size: int) -> None:
    """This process's rank and the group size; forgets any symmetric-memory buffer (it belonged to the old group)."""
    global _tp_rank, _tp_size, _symm_mem
    _tp_rank, _tp_size = rank, size
    _symm_mem = None


def setup_symm_mem_all_reduce(device: torch.device, limits: SymmMemLimits | None = None) -> SymmMemAllReduce | None:
    """Switch small all-reduces to symmetric memory as ``limits`` (default: the environment variables) say; a
    collective: every rank calls it, right after joining the group, before any CUDA graph is captured.
    Returns the path, or None when the limits leave everything to NCCL (or there is one rank, or no GPU)."""
    global _symm_mem
    limits = SymmMemLimits.from_env() if limits is None else limits
    if not limits.enabled or _tp_size == 1 or device.type != "cuda":
        return None
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # NVLink multicast stays off
    try:
        _symm_mem = SymmMemAllReduce(limits, device, dist.group.WORLD)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the switch was asked for: say why it cannot work here
        raise ConfigError(
            f"symmetric-memory all-reduce ({ONE_SHOT_ENV}={limits.one_shot_max_bytes}, {TWO_SHOT_ENV}="
            f"{limits.two_shot_max_bytes}) cannot start on {device}: {type(exc).__name__}: {exc}; unset both "
            "variables to use NCCL"
        ) from exc
    return _symm_mem


def all_reduce_method(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> str:
    """Which path :func:`all_reduce` takes for ``x``: ``"none"`` (one rank), ``"one_shot"``, ``"two_shot"``
    or ``"nccl"`` (the process group's backend, gloo on CPU)."""
    if _tp_size == 1:
        return "none"
    if _symm_mem is None or op != dist.ReduceOp.SUM:
        return "nccl"
    return _symm_mem.method(x)


def set_peer_failure_check(check: Callable[[], None] | None) -> None:
    """``check`` raises a clear error when a peer rank is gone (rank 0's tensor-parallel group sets it): a
    collective that fails is explained by it instead of by the backend's low-level message."""
    global _peer_failure_check
    _peer_failure_check = check


def _explain(exc: Exception) -> None:
    """Raise the check's error (chained to ``exc``) if it finds a peer gone within a second: a peer killed
    mid-collective closes its connections a moment before its process can be seen to have ended."""
    if _peer_failure_check is None:
        return
    deadline = time.monotonic() + 1.0
    while True:
        try:
            _peer_failure_check()
        except Exception as clear:
            raise clear from exc
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over the tensor-parallel ranks (a sum unless ``op`` says otherwise); returns ``x``."""
    if _tp_size > 1:
        if _symm_mem is not None and op == dist.ReduceOp.SUM:
            method = _symm_mem.method(x)
            if method != "nccl":
                _symm_mem(x, method)
                return x
        try:
            dist.all_reduce(x, op=op)
        except RuntimeError as exc:
            _explain(exc)
            raise
    return x


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Overwrite ``x`` on every rank with rank 0's ``x`` (in place; a no-op with one rank); returns ``x``."""
    if _tp_size > 1:
        try:
            dist.broadcast(x, src=0)
        except RuntimeError as exc:
            _explain(exc)
            raise
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (rank order)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    try:
        dist.all_gather(parts, x.contiguous())
    except RuntimeError as exc:
        _explain(exc)
        raise
    return torch.cat(parts, dim=-1)
