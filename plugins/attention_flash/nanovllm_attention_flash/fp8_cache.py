"""The FP8 KV cache (``kv_cache_dtype = "fp8"``): layout, quantisation and dequantisation in plain PyTorch.

Values are float8 e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, largest finite value 448) with one float32
scale per (token, KV head) row of ``head_dim`` values, computed when the row is stored:
``scale = amax(|row|) / 448`` and ``value = round_to_nearest_even(row / scale)``; reading gives
``value * scale``. Scales are dynamic, so nothing is calibrated and nothing can overflow; a row's error is at
most half an e4m3 step of its own largest element (relative error <= 2**-4 for elements within 64x of that
element, about 1-2% on average). The cost is 4 bytes per ``head_dim`` bytes (3% at head_dim 128).

One layer's cache is a ``uint8`` tensor ``(2, num_blocks * block_size * num_kv_heads * (head_dim + 4))``; row 0
holds keys and row 1 values, each laid out as

- ``num_blocks * block_size * num_kv_heads * head_dim`` bytes of e4m3 values, ``[num_blocks, block_size,
  num_kv_heads, head_dim]`` (the default cache layout, so tiles stay 16-byte loads and TMA boxes),
- then ``num_blocks * num_kv_heads * block_size`` float32 scales, ``[num_blocks, num_kv_heads, block_size]``
  (a kernel reading one head's tile of keys finds their scales side by side).

A backend tells an FP8 cache from a default one by its ``uint8`` type (:func:`is_fp8_cache`), so a cache
allocated in the model's dtype (the runner's memory-profiling scratch cache) still takes the default path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "fp8")  # what the `torch` and `triton` backends store
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
SCALE_BYTES = 4  # one float32 per (token, KV head)


class Fp8Cache(NamedTuple):
    """Views of one layer's FP8 cache: ``values[0]``/``values[1]`` are keys/values ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (e4m3), ``scales[0]``/``scales[1]`` their ``[num_blocks, num_kv_heads, block_size]``
    float32 scales."""

    values: torch.Tensor
    scales: torch.Tensor


class Fp8CacheSupport:
    """``AttentionBackend`` classmethods of a backend that also stores ``kv_cache_dtype = "fp8"`` in this module's
    layout; listed before ``AttentionBackend`` among the bases."""

    fp8_kernels_on_cuda: bool = False  # its CUDA kernels convert e4m3 in hardware: an NVIDIA GPU of 8.9+

    @classmethod
    def check_kv_cache_dtype(cls, kv_cache_dtype: str, device: torch.device) -> str | None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            supported = ", ".join(map(repr, KV_CACHE_DTYPES))
            return f"kv_cache_dtype {kv_cache_dtype!r} is not supported (supported: {supported})"
        if kv_cache_dtype == "fp8" and cls.fp8_kernels_on_cuda and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9) or torch.version.hip is not None:
                return f"kv_cache_dtype 'fp8' needs an NVIDIA GPU of compute capability 8.9+, not {major}.{minor}"
        return None

    @classmethod
    def kv_cache_spec(
        cls,
        kv_cache_dtype: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[tuple[int, ...], torch.dtype]:
        if kv_cache_dtype == "fp8":
            return fp8_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), torch.uint8
        return super().kv_cache_spec(kv_cache_dtype, num_blocks, block_size, num_kv_heads, head_dim, dtype)


def fp8_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Shape of one layer's ``uint8`` FP8 cache."""
    return (2, num_blocks * block_size * num_kv_heads * (head_dim + SCALE_BYTES))


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.uint8


def fp8_views(kv_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> Fp8Cache:
    """The value and scale views of a layer's FP8 cache (no copy)."""
    row_bytes = block_size * num_kv_heads * (head_dim + SCALE_BYTES)
    if kv_cache.dim() != 2 or kv_cache.shape[0] != 2 or kv_cache.shape[1] % row_bytes:
        raise ValueError(
            f"not an FP8 KV cache for block_size {block_size}, {num_kv_heads} KV heads, head_dim {head_dim}: "
            f"shape {tuple(kv_cache.shape)} (expected (2, num_blocks * {row_bytes}))"
        )
    num_blocks = kv_cache.shape[1] // row_bytes
    split = num_blocks * block_size * num_kv_heads * head_dim
    values = kv_cache[:, :split].view(FP8_DTYPE).unflatten(1, (num_blocks, block_size, num_kv_heads, head_dim))
    scales = kv_cache[:, split:].view(torch.float32).unflatten(1, (num_blocks, num_kv_heads, block_size))
    return Fp8Cache(values, scales)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (e4m3 values ``[..., head_dim]``, float32 scales ``[...]``), one scale per row.

    An all-zero row gets scale 0 (and reads back as zeros). The Triton store kernel computes bit-identical
    values and scales (same IEEE divisions, round to nearest even), on every device.
    """
    x = x.float()
    amax = x.abs().amax(-1)
    # Divide by a tensor, not by the Python float: CUDA PyTorch turns `tensor / cpu_scalar` into a multiplication
    # by the float32 reciprocal (1/448 is inexact), which rounds many scales one float32 ulp away from
    # amax / 448, and the values at exact e4m3 midpoints (frequent: bf16 inputs, scales that divide them
    # exactly) then round the other way: bytes one e4m3 step off the Triton kernel's.
    scale = amax / torch.full_like(amax, FP8_MAX)
    divisor = torch.where(scale > 0, scale, 1.0)
    return (x / divisor.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scales`` (scales broadcast over the last dim) in ``dtype``."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def store_fp8(k: torch.Tensor, v: torch.Tensor, cache: Fp8Cache, slot_mapping: torch.Tensor) -> None:
    """Quantise ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into ``cache`` at ``slot_mapping`` (``-1``: skipped)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    num_blocks, block_size, num_kv_heads, head_dim = cache.values.shape[1:]
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    for i, x in enumerate((k, v)):
        values, scales = quantize_fp8(x)
        # index_copy_ has no float8 kernel everywhere: copy the bytes
        flat = cache.values[i].view(torch.uint8).view(num_blocks * block_size, num_kv_heads, head_dim)
        flat.index_copy_(0, slot_mapping, values.view(torch.uint8))
        cache.scales[i][blocks, :, rows] = scales


def gather_fp8(cache: Fp8Cache, which: int, blocks: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` tokens of the keys (``which=0``) or values (1) in ``blocks``, dequantised:
    ``[length, num_kv_heads, head_dim]`` in ``dtype``."""
    values = cache.values[which][blocks].flatten(0, 1)[:length]
    scales = cache.scales[which][blocks].transpose(1, 2).flatten(0, 1)[:length]
    return dequantize_fp8(values, scales, dtype)


def to_fp8_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """A default-layout cache ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` quantised into a new FP8
    cache (tests and benchmarks: every slot is quantised, NaN fill included)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    out = torch.zeros(
        fp8_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.uint8, device=kv_cache.device
    )
    cache = fp8_views(out, block_size, num_kv_heads, head_dim)
    for i in range(2):
        values, scales = quantize_fp8(kv_cache[i])
        cache.values[i].copy_(values)
        cache.scales[i].copy_(scales.transpose(1, 2))
    return out
