"""A projection with the RMSNorm before it, or the SwiGLU activation before it, in one Triton GEMM on decode-size
batches.

A decode step of a small model is a chain of a few hundred kernels of a few microseconds each, and each kernel
costs its launch and ramp whatever its work. Folding a layer's two RMSNorms into the projections after them
(``qkv``, ``gate_up``) and SwiGLU's ``silu(gate) * up`` into ``down`` takes three kernels a layer out of the
chain. The GEMM is :mod:`nanovllm_core.layers.gemm_kernel`'s; its launch shapes come from a table measured per
device (``gemm_configs.json``) and cover batches of up to the table's largest row count. Elsewhere (another
device, more rows, a projection with bias, CPU) these run the unfused layers, unchanged.

The engine turns this on with :func:`set_fused_gemms` (config ``fuse_decode_gemms``).
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from pathlib import Path

import torch

from nanovllm_core.layers.gemm_config import GemmConfig, parse_config
from nanovllm_core.layers.linear import RowParallelLinear, _Linear
from nanovllm_core.layers.norm import RMSNorm

_enabled = False


def set_fused_gemms(enabled: bool) -> None:
    """Use the fused Triton GEMMs where the device's table covers the shape (True), or never (False)."""
    global _enabled
    _enabled = enabled


CONFIGS_ENV = "NANOVLLM_GEMM_CONFIGS"


@cache
def _device_table(device_name: str) -> dict[tuple[int, int], list[tuple[int, GemmConfig | None]]]:
    """``{(out, in): [(up to rows, config or None: unfused), ...]}`` for one device, from ``$NANOVLLM_GEMM_CONFIGS``
    (a JSON file of the same form as ``gemm_configs.json``, e.g. written by ``benchmarks/fused_gemm.py``) if set,
    else from the table shipped with the package."""
    path = os.environ.get(CONFIGS_ENV)
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("nanovllm_core.layers").joinpath("gemm_configs.json").read_text()
    table = {}
    for shape, entries in json.loads(text).get(device_name, {}).items():
        n, k = (int(v) for v in shape.split("x"))
        table[(n, k)] = [(rows, parse_config(c) if c else None) for rows, c in entries]
    return table


@cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def decode_gemm_config(weight: torch.Tensor, rows: int, *, split_ok: bool = True) -> GemmConfig | None:
    """The tuned launch shape for ``rows`` activations times ``weight`` (``[out, in]``) on its device, or
    ``None``: fusion off, not CUDA, no table entry for the shape, more rows than measured, or (``split_ok=False``)
    a split of K where the caller's prologue needs whole rows."""
    if not _enabled or weight.device.type != "cuda" or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    entries = _device_table(_device_name(weight.device.index or 0)).get(tuple(weight.shape))
    for max_rows, config in entries or ():
        if rows <= max_rows:
            return config if config is not None and (split_ok or config.split_k == 1) else None
    return None


def norm_then_linear(
    norm: RMSNorm, linear: _Linear, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)``; without ``residual``, ``(linear(norm(x)), x)``."""
    config = None
    if linear.bias is None and x.dim() == 2 and x.is_contiguous() and not isinstance(linear, RowParallelLinear):
        config = decode_gemm_config(linear.weight, x.size(0), split_ok=False)
    if config is None:
        if residual is None:
            return linear(norm(x)), x
        normed, residual = norm(x, residual)
        return linear(normed), residual
    from nanovllm_core.layers.gemm_kernel import gemm

    return gemm(x, linear.weight, config, prologue="norm", norm_weight=norm.weight, residual=residual, eps=norm.eps)


def silu_mul_then_linear(linear: _Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(silu(gate) * up)`` for ``x = [gate, up]`` along its last dimension (SwiGLU, then the projection)."""
    config = None
    if linear.bias is None and x.dim() == 2 and x.stride(1) == 1:
        config = decode_gemm_config(linear.weight, x.size(0))
    if config is None:
        from nanovllm_core.layers.fused import silu_and_mul

        return linear(silu_and_mul(x))
    from nanovllm_core.layers.gemm_kernel import gemm

    y = gemm(x, linear.weight, config, prologue="silu")
    return linear.reduce_output(y) if isinstance(linear, RowParallelLinear) else y
