"""``triton``: the project's own paged-attention kernels, written in Triton (see ``triton_kernels``).

This module imports no ``triton`` at import time, so the plugin still loads (and ``check_available`` explains
why the backend cannot run) on a machine without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanovllm_core import AttentionBackend, AttentionBatch, ConfigError

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _kernels():
    from nanovllm_attention_flash import triton_kernels

    return triton_kernels


def triton_import_error() -> str | None:
    """``None`` if ``triton`` imports, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"triton is not importable ({type(exc).__name__}: {exc}); install it with `pip install triton`"
    return None


@dataclass
class TritonMetadata:
    """What ``forward`` needs beyond the runner's batch; every field is host data computed without a sync.

    ``decode_only``: every sequence has at most one query token (``max_query_len <= 1``): only the decode
    kernel runs. Otherwise the prefill kernel runs, and ``num_single_token_seqs > 0`` (known from
    ``query_start_loc_cpu``) routes the one-token sequences of a mixed batch to the decode kernel.
    ``num_splits`` is the decode kernel's KV-split count, chosen from static sizes (batch rows, head count,
    block-table width), so a captured CUDA graph stays valid for every replay of the same batch size.
    """

    batch: AttentionBatch
    decode_only: bool
    num_splits: int
    num_single_token_seqs: int


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with this project's Triton kernels: KV store, split-KV decode, paged varlen prefill.

    KV-cache layout: the core's default ``(2, num_blocks, block_size, num_kv_heads, head_dim)``. Block sizes:
    any power of two from 16 to 256. Head sizes 64, 128, 256; float16 and bfloat16 on CUDA (float32 too, with
    IEEE-precision dots). On CPU the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` (tests).

    The decode path (``max_query_len <= 1``) performs no host-device sync and allocates only tensors whose sizes
    follow from the batch's static shape, so ``forward`` can be captured in a CUDA graph for a fixed batch
    size. Padding rows (``seq_lens == 0``, slot ``-1``) produce zeros. ``forward`` expects each token to
    belong to one sequence (``query_start_loc[-1] == num_tokens``).
    """

    name = "triton"
    priority = 30  # the fastest end to end on an H200 (docs/benchmarks.md), so `auto` takes it first
    supports_cuda_graph = True

    class Options(BaseModel):
        """``[plugins] attention_options`` understood by this backend (all optional; for tuning)."""

        model_config = ConfigDict(extra="forbid")

        num_kv_splits: int | None = Field(
            None, ge=1, le=64, description="Fixed decode KV-split count (a power of two); default: per batch size."
        )
        decode_block_n: int | None = Field(None, ge=16, le=256, description="Keys per decode tile (power of two).")
        decode_num_warps: int | None = Field(None, ge=1, le=16)
        decode_num_stages: int | None = Field(None, ge=1, le=6)
        prefill_block_m: int | None = Field(None, ge=16, le=256, description="Queries per prefill tile.")
        prefill_block_n: int | None = Field(None, ge=16, le=256, description="Keys per prefill tile.")
        prefill_num_warps: int | None = Field(None, ge=1, le=16)
        prefill_num_stages: int | None = Field(None, ge=1, le=6)
        prefill_use_tma: bool | None = Field(
            None, description="Load prefill K/V tiles through TMA descriptors (compute capability 9.0+; else ignored)."
        )

    @classmethod
    def check_available(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        reason = triton_import_error()
        if reason is not None:
            return reason
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {head_dim} is not supported (supported: {list(SUPPORTED_HEAD_DIMS)})"
        if device.type == "cuda":
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                return f"dtype {dtype} is not supported (float16, bfloat16, float32)"
            major, _ = torch.cuda.get_device_capability(device)
            if major < 8 and dtype == torch.bfloat16:
                return "bfloat16 needs compute capability 8.0 or newer"
            return None
        if os.environ.get("TRITON_INTERPRET") == "1":
            if dtype not in (torch.float32, torch.float16):
                return f"Triton's interpreter runs float32 and float16, not {dtype}"
            return None
        return (
            f"needs a CUDA device (got {device.type}); set TRITON_INTERPRET=1 to run its kernels in Triton's "
            "interpreter on CPU (slow, for tests)"
        )

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        return [16, 32, 64, 128, 256]

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        **options: Any,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        try:
            self.options = self.Options(**options)
        except ValidationError as exc:
            raise ConfigError(f"invalid plugins.attention_options for the triton backend: {exc}") from None
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        kernels = _kernels()
        opts = self.options
        decode = kernels.default_decode_config(head_dim, block_size)
        self.decode_config = kernels.DecodeConfig(
            block_n=opts.decode_block_n or decode.block_n,
            num_warps=opts.decode_num_warps or decode.num_warps,
            num_stages=opts.decode_num_stages or decode.num_stages,
        )
        prefill = kernels.default_prefill_config(head_dim, block_size, dtype, torch.device(device))
        self.prefill_config = kernels.PrefillConfig(
            block_m=opts.prefill_block_m or prefill.block_m,
            block_n=opts.prefill_block_n or prefill.block_n,
            num_warps=opts.prefill_num_warps or prefill.num_warps,
            num_stages=opts.prefill_num_stages or prefill.num_stages,
            use_tma=prefill.use_tma if opts.prefill_use_tma is None else opts.prefill_use_tma,
        )
        tiles = {"decode_block_n": self.decode_config.block_n, "prefill_block_n": self.prefill_config.block_n}
        for what, tile in tiles.items():
            if tile & (tile - 1) or block_size % tile:
                raise ConfigError(f"{what}={tile} must be a power of two dividing kvcache_block_size ({block_size})")
        if opts.num_kv_splits is not None and opts.num_kv_splits & (opts.num_kv_splits - 1):
            raise ConfigError(f"num_kv_splits={opts.num_kv_splits} must be a power of two")
        self._num_sms = kernels.num_sms(torch.device(device))

    def _num_splits(self, num_rows: int, batch: AttentionBatch) -> int:
        if self.options.num_kv_splits is not None:
            return self.options.num_kv_splits
        max_context = batch.block_tables.shape[1] * batch.block_size
        return _kernels().choose_num_splits(
            num_rows, self.num_kv_heads, max_context, self.decode_config.block_n, self._num_sms
        )

    def build_metadata(self, batch: AttentionBatch) -> TritonMetadata:
        if batch.max_query_len <= 1:
            return TritonMetadata(batch, True, self._num_splits(batch.num_seqs, batch), 0)
        qsl = batch.query_start_loc_cpu
        single = sum(1 for a, b in zip(qsl, qsl[1:]) if b - a == 1) if qsl else 0
        return TritonMetadata(batch, False, self._num_splits(single, batch) if single else 1, single)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonMetadata
    ) -> torch.Tensor:
        _kernels().store_kv(k, v, kv_cache[0], kv_cache[1], metadata.batch.slot_mapping)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonMetadata) -> torch.Tensor:
        """The attention part of ``forward``: the step's keys/values are already in ``kv_cache``."""
        kernels = _kernels()
        batch = metadata.batch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        common = (q, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out, self.scale)
        if not metadata.decode_only:
            kernels.prefill_attention(
                *common, batch.num_seqs, self.prefill_config, skip_single=metadata.num_single_token_seqs > 0
            )
        if metadata.decode_only or metadata.num_single_token_seqs:
            kernels.decode_attention(*common, batch.num_seqs, metadata.num_splits, self.decode_config)
        return out
