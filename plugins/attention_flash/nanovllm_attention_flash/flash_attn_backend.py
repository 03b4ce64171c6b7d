"""``flash_attn``: paged attention through flash-attn-4 (``flash_attn.cute``, CuTe DSL kernels for Hopper and
Blackwell); the new keys/values are stored with this plugin's Triton store kernel.

Nothing here imports ``flash_attn`` or ``triton`` at module import time: the plugin loads without them and
``check_available`` says what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from types import ModuleType
from typing import Any

import torch

from nanovllm_attention_flash.triton_backend import triton_import_error
from nanovllm_core import AttentionBackend, AttentionBatch

INSTALL_HINT = "pip install 'nanovllm-attention-flash[flash]'"


def load_flash_attn_varlen_func() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_attn_import_error() -> str | None:
    """``None`` if ``flash_attn.cute.flash_attn_varlen_func`` imports, else why not."""
    try:
        load_flash_attn_varlen_func()
    except Exception as exc:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"flash-attn-4 (flash_attn.cute) is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


class FlashAttnBackend(AttentionBackend):
    """Paged varlen attention with flash-attn-4's ``flash_attn_varlen_func`` on the core's default cache layout.

    ``kv_cache[0]``/``kv_cache[1]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``, which is exactly
    flash-attn-4's paged K/V layout (``page_table`` = the block tables, ``seqused_k`` = ``seq_lens``); one call
    serves decode, prefill, chunked prefill, prefix-cache hits and mixed batches (``causal=True`` aligns each
    sequence's queries to the end of its keys).

    Decode passes only static bounds (``max_seqlen_q=1``, key bound = block-table capacity), allocates only
    static-size tensors and syncs nothing, so it can be captured in a CUDA graph once flash-attn-4 has
    compiled the kernel (the runner's warm-up run does that before capture).

    Requirement on the cache: flash-attn-4's TMA path (page size == its key tile, e.g. 128 for head_dim
    <= 128 on Hopper) reads the whole last page of a sequence, so rows past ``seq_lens`` in a partly filled
    block must hold finite values (a zero-initialised cache guarantees it; NaN garbage there would leak into
    the output through ``0 * NaN``).
    """

    name = "flash_attn"
    priority = 20  # below triton, whose paged decode runs the nano-vllm workload faster end to end
    supports_cuda_graph = True

    @classmethod
    def check_available(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device with compute capability 9.x or 10.x (got {device.type})"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {dtype} is not supported (float16, bfloat16)"
        major, minor = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return f"flash-attn-4 needs compute capability 9.x (Hopper) or 10.x (Blackwell), not {major}.{minor}"
        # flash-attn-4's own limits: multiples of 8 up to 256 on Hopper; up to 128, or 256, on Blackwell
        if head_dim % 8 or not 8 <= head_dim <= 256 or (major == 10 and 128 < head_dim < 256):
            return f"head_dim {head_dim} is not supported by flash-attn-4 on compute capability {major}.x"
        return flash_attn_import_error() or triton_import_error()

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        # What flash-attn-4 (checked against 4.0.0b36's interface and paged-KV loader) accepts: its paged KV
        # takes any page size. A page equal to the kernel's key tile (128 for head_dim <= 128 on Hopper) is
        # loaded with TMA, any other size goes through the cp.async loader, which resolves the page of every
        # row (so 16, 32, 64 and 256 work too; flash-attn's own paged tests cover 16..256). Measured on an
        # H200: 128 and 256; the GPU tests here also run 16 and 64.
        return [16, 32, 64, 128, 256]

    @classmethod
    def check_kv_cache_dtype(cls, kv_cache_dtype: str, device: torch.device) -> str | None:
        if kv_cache_dtype == "auto":
            return None
        # flash-attn-4 reads an FP8 cache only on Blackwell, with one descale factor per (sequence, KV head); its
        # Hopper kernels (this backend's H100/H200 target) take 16-bit K/V only, and neither can read this
        # plugin's per-token scales
        return (
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported: flash-attn-4 has no FP8 KV cache path on "
            "Hopper and none for per-token scales (supported: 'auto')"
        )

    # loaded on first use (check_available has seen them import): the constructor is the base class's, which
    # rejects any option, since this backend takes none
    @cached_property
    def _varlen(self) -> Callable[..., Any]:
        return load_flash_attn_varlen_func()

    @cached_property
    def _kernels(self) -> ModuleType:
        from nanovllm_attention_flash import triton_kernels

        return triton_kernels

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionBatch
    ) -> torch.Tensor:
        self._kernels.store_kv(k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionBatch) -> torch.Tensor:
        """The attention part of ``forward``: the step's keys/values are already in ``kv_cache``."""
        decode = metadata.max_query_len <= 1
        result = self._varlen(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=metadata.query_start_loc,
            seqused_k=metadata.seq_lens,
            page_table=metadata.block_tables,
            max_seqlen_q=1 if decode else metadata.max_query_len,
            # decode: the block-table capacity (static, valid for every CUDA-graph replay); else the real bound
            max_seqlen_k=None if decode else metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
        )
        return result[0] if isinstance(result, tuple) else result
