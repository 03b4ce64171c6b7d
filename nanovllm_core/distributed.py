"""Tensor-parallel state of this process. With one rank every collective is a no-op."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

_tp_rank = 0
_tp_size = 1
_peer_failure_check: Callable[[], None] | None = None


def set_tensor_parallel(rank: int, size: int) -> None:
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, size


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
        try:
            dist.all_reduce(x, op=op)
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
