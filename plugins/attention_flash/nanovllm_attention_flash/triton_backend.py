"""``triton``: the project's own paged-attention kernels, written in Triton (see ``triton_kernels``).

This module imports no ``triton`` at import time, so the plugin still loads (and ``check_available`` explains
why the backend cannot run) on a machine without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from nanovllm_attention_flash.fp8_cache import Fp8CacheSupport, fp8_views, is_fp8_cache
from nanovllm_core import AttentionBackend, AttentionBatch, ConfigError

SUPPORTED_HEAD_DIMS = (64, 128, 256)
COUNTER_ROWS = 4096  # decode split counters made at once: any batch up to this many sequences


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
    ``num_splits`` is the decode kernel's KV splits a sequence on average, chosen from static sizes (batch rows,
    head count, block-table width), so a captured CUDA graph stays valid for every replay of the same batch size;
    the kernel deals them out by context length.

    ``decode_plan``: the decode kernel's split plan (``triton_kernels.split_plan``), which depends on the step's
    lengths only, so the first layer makes it and every other layer reads it; ``plan_cache`` is the address of
    the cache of the layer that made it. A call on that layer again starts another pass over the model (the
    warm-up before a CUDA-graph capture, then the capture; a repeated call in a test) and makes it anew.
    """

    batch: AttentionBatch
    decode_only: bool
    num_splits: int
    num_single_token_seqs: int
    decode_plan: torch.Tensor | None = None
    plan_cache: int | None = None


class TritonAttentionBackend(Fp8CacheSupport, AttentionBackend):
    """Paged attention with this project's Triton kernels: KV store, split-KV decode, paged varlen prefill.

    KV-cache layout: the core's default ``(2, num_blocks, block_size, num_kv_heads, head_dim)``, or with
    ``kv_cache_dtype = "fp8"`` the FP8 cache of ``fp8_cache`` (compute capability 8.9+). Block sizes:
    any power of two from 16 to 256. Head sizes 64, 128, 256; float16 and bfloat16 on CUDA (float32 too, with
    IEEE-precision dots). On CPU the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` (tests).

    The decode path (``max_query_len <= 1``) performs no host-device sync and allocates only tensors whose sizes
    follow from the batch's static shape, so ``forward`` can be captured in a CUDA graph for a fixed batch
    size. Padding rows (``seq_lens == 0``, slot ``-1``) produce zeros. ``forward`` expects each token to
    belong to one sequence (``query_start_loc[-1] == num_tokens``).
    """

    name = "triton"
    priority = 30  # its paged decode is the fastest of the bundled backends end to end, so `auto` takes it first
    supports_cuda_graph = True
    fp8_kernels_on_cuda = True
    supports_cuda_graph_mixed = True  # both kernels' grids follow from num_tokens and num_seqs alone

    class Options(BaseModel):
        """``[plugins] attention_options`` understood by this backend (all optional; for tuning)."""

        model_config = ConfigDict(extra="forbid")

        num_kv_splits: int | None = Field(
            None,
            ge=1,
            le=64,
            description="Decode KV splits a sequence on average, dealt out by context length (a power of two); "
            "default: per batch size.",
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionBackend``'s arguments; it checks the options against ``Options`` into ``self.options``."""
        super().__init__(*args, **kwargs)
        num_heads, num_kv_heads, head_dim, block_size = (self.num_heads, self.num_kv_heads, self.head_dim,
                                                         self.block_size)  # fmt: skip
        device = torch.device(self.device)
        kernels = _kernels()
        opts = self.options
        # one decode tile for 16-bit caches and one for FP8 caches; the decode_* options set both
        self.decode_config, self.fp8_decode_config = (
            kernels.DecodeConfig(
                block_n=opts.decode_block_n or default.block_n,
                num_warps=opts.decode_num_warps or default.num_warps,
                num_stages=opts.decode_num_stages or default.num_stages,
            )
            for default in (
                kernels.default_decode_config(head_dim, block_size),
                kernels.default_decode_config(head_dim, block_size, fp8=True, group=num_heads // num_kv_heads),
            )
        )
        self._split_config = self.decode_config  # the cache's tile, once warmup() has seen the cache
        prefill = kernels.default_prefill_config(head_dim, block_size, self.dtype, device)
        self.prefill_config = kernels.PrefillConfig(
            block_m=opts.prefill_block_m or prefill.block_m,
            block_n=opts.prefill_block_n or prefill.block_n,
            num_warps=opts.prefill_num_warps or prefill.num_warps,
            num_stages=opts.prefill_num_stages or prefill.num_stages,
            use_tma=prefill.use_tma if opts.prefill_use_tma is None else opts.prefill_use_tma,
        )
        # (decode_block_n sets both decode tiles; the FP8 default, min(32, block_size), always divides)
        tiles = {"decode_block_n": self.decode_config.block_n, "prefill_block_n": self.prefill_config.block_n}
        for what, tile in tiles.items():
            if tile & (tile - 1) or block_size % tile:
                raise ConfigError(f"{what}={tile} must be a power of two dividing kvcache_block_size ({block_size})")
        if opts.num_kv_splits is not None and opts.num_kv_splits & (opts.num_kv_splits - 1):
            raise ConfigError(f"num_kv_splits={opts.num_kv_splits} must be a power of two")
        self._num_sms = kernels.num_sms(device)
        self._fp8_views: dict[tuple[int, tuple[int, ...]], tuple] = {}
        self._counters: torch.Tensor | None = None  # the decode kernel's split counters (see _split_counters)

    def _num_splits(self, num_rows: int, batch: AttentionBatch) -> int:
        if self.options.num_kv_splits is not None:
            return self.options.num_kv_splits
        max_context = batch.block_tables.shape[1] * batch.block_size
        tile = self._split_config
        return _kernels().choose_num_splits(
            num_rows, self.num_kv_heads, max_context, tile.block_n, self._num_sms, tile.num_warps
        )

    def _split_counters(self, num_seqs: int) -> torch.Tensor:
        """The decode kernel's zeroed counters, one per (sequence, KV head), shared by every layer and step (each
        launch leaves them zero); made at the first decode, before any CUDA graph is captured, for
        ``COUNTER_ROWS`` sequences, and remade larger (outside a capture) for a larger batch."""
        counters = self._counters
        if counters is None or counters.shape[0] < num_seqs:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"a captured decode step of {num_seqs} sequences needs its counters made before")
            rows = max(COUNTER_ROWS, num_seqs)
            counters = self._counters = _kernels().split_counters(rows, self.num_kv_heads, torch.device(self.device))
        return counters

    def build_metadata(self, batch: AttentionBatch) -> TritonMetadata:
        if batch.max_query_len <= 1:
            return TritonMetadata(batch, True, self._num_splits(batch.num_seqs, batch), 0)
        qsl = batch.query_start_loc_cpu
        single = sum(1 for a, b in zip(qsl, qsl[1:]) if b - a == 1) if qsl else 0
        return TritonMetadata(batch, False, self._num_splits(single, batch) if single else 1, single)

    def build_graph_metadata(self, batch: AttentionBatch) -> TritonMetadata:
        """A captured step with prompt tokens: the prefill kernel over every row (padding rows have no query
        token and exit), the decode kernel beside it for the rows with one query token, its split count fixed
        by the row count."""
        return TritonMetadata(batch, False, self._num_splits(batch.num_seqs, batch), batch.num_seqs)

    def warmup(self, kv_cache: torch.Tensor) -> None:
        """Compile and load every kernel variant ``forward`` can launch on caches like ``kv_cache`` (one layer's),
        so that no Triton JIT compile lands in the first requests: each step of :meth:`warmup_steps` runs once.
        Interpreted kernels (CPU) compile nothing, so there it returns at once. The cache's type also picks the
        decode tile that the split counts of later steps are chosen for (FP8 or 16-bit)."""
        self._split_config = self.fp8_decode_config if is_fp8_cache(kv_cache) else self.decode_config
        if torch.device(self.device).type != "cuda":
            return
        with torch.inference_mode():
            for q, k, v, metadata in self.warmup_steps(kv_cache):
                self.forward(q, k, v, kv_cache, metadata)
        torch.cuda.synchronize(self.device)

    def warmup_steps(
        self, kv_cache: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, TritonMetadata]]:
        """Tiny ``forward`` calls that together launch every kernel variant a step can: the KV store of this cache's
        type; pure decode with a batch in each of the split plan's ``SEQS_BUCKETS`` (larger batches than the last
        compile when they come); a prefill alone, and beside a one-token sequence (a mixed batch: the prefill kernel
        skips that one, the decode kernel takes it). The prefill's K/V load path (pointers or TMA) is the one this cache
        takes. Every key and value is stored at slot -1 (nowhere) and every context is block 0's first rows, so the
        cache is only read. Every other argument a variant depends on (dtypes, 16-byte alignment, strides divisible by
        16) is the same as in the engine's steps; integers that vary per batch are not specialised
        (``triton_kernels._kernel_set``)."""
        kernels = _kernels()
        device = torch.device(self.device)

        def step(query_lens: list[int], single: int, splits: int) -> tuple:
            n = sum(query_lens)
            qsl = [0]
            for length in query_lens:
                qsl.append(qsl[-1] + length)
            seq_lens = query_lens  # nothing cached before: the context is the new tokens (rows of block 0)
            batch = AttentionBatch(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                block_tables=torch.zeros((len(query_lens), 1), dtype=torch.int32, device=device),
                slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                num_seqs=len(query_lens),
                num_tokens=n,
                block_size=self.block_size,
                query_start_loc_cpu=qsl,
                seq_lens_cpu=seq_lens,
            )
            q = torch.zeros((n, self.num_heads, self.head_dim), dtype=self.dtype, device=device)
            kv = torch.zeros((n, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=device)
            decode_only = max(query_lens) == 1
            return q, kv, kv, TritonMetadata(batch, decode_only, splits, 0 if decode_only else single)

        # the split plan's kernel is compiled per batch-size bucket (its vector); the split count is not compiled in
        sizes = [1] + [bucket + 1 for bucket in kernels.SEQS_BUCKETS[:-1]]
        steps = [step([1] * n, 0, 2) for n in sizes]
        steps.append(step([2], 0, 1))  # the prefill kernel alone
        steps.append(step([2, 1], 1, 1))  # the prefill kernel beside the decode kernel
        return steps

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Keys, values and (for an FP8 cache) the ``key_scales``/``value_scales`` keyword arguments.

        An FP8 cache's views are built once per layer cache (otherwise a handful of view ops, twice per layer and
        step, on the host's critical path): keyed by address and shape, which no other tensor can share while the
        views keep it alive.
        """
        if not is_fp8_cache(kv_cache):
            return kv_cache[0], kv_cache[1], {}
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        views = self._fp8_views.get(key)
        if views is None:
            values, scales = fp8_views(kv_cache, self.block_size, self.num_kv_heads, self.head_dim)
            views = self._fp8_views[key] = (values[0], values[1], {"key_scales": scales[0], "value_scales": scales[1]})
        return views

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonMetadata
    ) -> torch.Tensor:
        key_cache, value_cache, scales = self._cache_views(kv_cache)
        _kernels().store_kv(k, v, key_cache, value_cache, metadata.batch.slot_mapping, **scales)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonMetadata) -> torch.Tensor:
        """The attention part of ``forward``: the step's keys/values are already in ``kv_cache``."""
        kernels = _kernels()
        batch = metadata.batch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        key_cache, value_cache, scales = self._cache_views(kv_cache)
        common = (q, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out, self.scale)
        if not metadata.decode_only:
            kernels.prefill_attention(
                *common,
                batch.num_seqs,
                self.prefill_config,
                skip_single=metadata.num_single_token_seqs > 0,
                **scales,
            )
        if metadata.decode_only or metadata.num_single_token_seqs:
            config = self.fp8_decode_config if scales else self.decode_config
            counters = self._split_counters(batch.num_seqs)
            if metadata.decode_plan is None or metadata.plan_cache == kv_cache.data_ptr():
                metadata.decode_plan = kernels.split_plan(
                    batch.seq_lens, batch.query_start_loc, batch.num_seqs, metadata.num_splits, config.block_n
                )
                metadata.plan_cache = kv_cache.data_ptr()
            kernels.decode_attention(
                *common, batch.num_seqs, metadata.num_splits, config, counters, **scales, plan=metadata.decode_plan
            )
        return out
