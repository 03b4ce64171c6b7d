"""Small elementwise functions that ``torch.compile`` fuses into one kernel each on CUDA.

A decode step of a small model is dominated by tiny kernels (an RMSNorm alone is about eight of them);
inside a CUDA graph each still costs a few microseconds of GPU time. The model runner turns compilation on
for CUDA (config ``compile_small_ops``); elsewhere these run eagerly, with the same arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

_enabled = False
F_ = TypeVar("F_", bound=Callable)


def set_compile(enabled: bool) -> None:
    """Compile (True) or run eagerly (False) every function below, process-wide."""
    global _enabled
    _enabled = enabled


def fused_enabled() -> bool:
    """Whether :func:`set_compile` turned fusion on: hand-fused kernels (such as ``qk_norm_rope``) follow it too."""
    return _enabled


_compiled: dict[Callable, Callable] = {}  # each function's torch.compile, made on its first call with fusion on


def fused(fn: F_) -> F_:
    @functools.wraps(fn)
    def dispatch(*args):
        if not _enabled:
            return fn(*args)
        compiled = _compiled.get(fn)
        if compiled is None:
            compiled = _compiled[fn] = torch.compile(fn, dynamic=True)
        return compiled(*args)

    return dispatch  # type: ignore[return-value]


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@fused
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.size(-1) else out


@fused
def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


@fused
def temperature_race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw from ``softmax(logits / T)`` per row, given ``noise ~ Exp(1)``.

    ``argmax(p / E) = argmax(log p - log E) = argmax(logits / T - log E)``: the softmax's normalisation does
    not change the argmax, so one fused pass over the logits suffices.
    """
    return (logits.float() / temperatures.unsqueeze(1) - noise.log()).argmax(dim=-1)
