"""Tensor-parallel state of this process. With one rank every collective is a no-op."""

from __future__ import annotations

import torch
import torch.distributed as dist

_tp_rank = 0
_tp_size = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, size


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (rank order)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
