"""FlashInfer's paged-KV layout, built from the engine's per-step metadata in plain PyTorch (no flashinfer import).

FlashInfer describes a batch of ``rows`` sequences over a paged cache with four int32 arrays:

- ``qo_indptr`` ``[rows + 1]``: the query tokens of row ``i`` are ``q[qo_indptr[i]:qo_indptr[i + 1]]`` (the
  engine's ``query_start_loc``);
- ``kv_indptr`` ``[rows + 1]``: the pages of row ``i`` are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``;
- ``kv_indices``: every row's pages (the engine's block ids), one row after the other;
- ``kv_last_page_len`` ``[rows]``: how many tokens of the row's last page belong to its context.

A row of ``seq_len`` tokens has ``ceil(seq_len / block_size)`` pages, the first entries of its block table, and
FlashInfer attends it to ``(pages - 1) * block_size + last_page_len == seq_len`` tokens. A row with no context (a
CUDA-graph padding row, ``seq_len == 0``) has no page and ``last_page_len`` 0, which FlashInfer reads as length 0
on the host and on the device alike. Queries are aligned to the end of their row's context (causal with offset
``seq_len - query_len``), so prompts, chunks over a cached prefix and decode tokens take one layout.

The cache is the core's ``(2, num_blocks, block_size, num_kv_heads, head_dim)``: ``kv_cache[0]`` and
``kv_cache[1]`` are FlashInfer's ``NHD`` page tensors ``[num_pages, page_size, num_kv_heads, head_dim]`` as they
are (:func:`paged_kv_views`, which also gives the FP8 cache's scales in the order FlashInfer reads them).

The functions compute on the device of their inputs without a host sync and, given ``out``, write in place, so
:meth:`GraphLayout.refresh` can run inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from nanovllm_attention_flash.fp8_cache import fp8_views, is_fp8_cache

from nanovllm_core import AttentionBatch


def num_pages(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pages (blocks) holding each row's context: ``ceil(seq_len / block_size)``."""
    return (seq_lens + (block_size - 1)) // block_size


def kv_indptr(seq_lens: torch.Tensor, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows + 1]`` int32: 0, then the running total of the rows' page counts."""
    if out is None:
        out = torch.empty(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    out[:1].zero_()
    torch.cumsum(num_pages(seq_lens, block_size), 0, dtype=torch.int32, out=out[1:])
    return out


def kv_last_page_len(seq_lens: torch.Tensor, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows]`` int32: tokens of each row's last page, 1 to ``block_size``; 0 for a row with no page."""
    last = seq_lens - (num_pages(seq_lens, block_size) - 1).clamp(min=0) * block_size
    return last.to(torch.int32) if out is None else out.copy_(last)


def kv_indices(
    block_tables: torch.Tensor,
    indptr: torch.Tensor,
    capacity: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row's pages, row after row: ``kv_indices[indptr[i] + j] = block_tables[i, j]`` for ``j`` below row
    ``i``'s page count (``indptr[i + 1] - indptr[i]``, at most the table's width).

    Built as a gather over the positions ``0 .. n - 1`` (``n``: ``capacity``, or ``out``'s size): each finds its
    row by a binary search in ``indptr``, so the output's size is fixed and nothing syncs. Positions past
    ``indptr[-1]`` (the unused tail of a fixed-capacity buffer) get some entry of the table; FlashInfer never
    reads them.
    """
    rows, width = block_tables.shape
    n = out.numel() if out is not None else capacity
    assert n is not None, "give capacity or out"
    position = torch.arange(n, dtype=indptr.dtype, device=indptr.device)
    row = torch.searchsorted(indptr[1:], position, right=True).clamp_(max=rows - 1)
    col = (position - indptr[row]).clamp_(0, width - 1)
    values = block_tables[row, col.long()]
    return values.to(torch.int32) if out is None else out.copy_(values)


@dataclass
class PagedKVLayout:
    """One step's arrays for FlashInfer's ``plan()``: the length arrays on the CPU (FlashInfer schedules the step
    on the host from them), ``kv_indices`` on the batch's device."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def step_layout(batch: AttentionBatch, pin_memory: bool = False) -> PagedKVLayout:
    """The layout of a step that runs eagerly: lengths from the batch's host lists, page indices gathered on its
    device from its block tables (the device copy of ``kv_indptr`` is computed there too, from ``seq_lens``, so
    no host-to-device copy precedes the gather). ``pin_memory``: pin the host arrays, so that FlashInfer's
    copies of them to a CUDA device do not block the host."""
    bs = batch.block_size
    seq_lens = torch.tensor(batch.seq_lens_cpu, dtype=torch.int32)
    indptr = kv_indptr(seq_lens, bs)
    indices = kv_indices(batch.block_tables, kv_indptr(batch.seq_lens, bs), capacity=int(indptr[-1]))
    host = [torch.tensor(batch.query_start_loc_cpu, dtype=torch.int32), indptr, kv_last_page_len(seq_lens, bs)]
    if pin_memory:
        host = [t.pin_memory() for t in host]
    qo_indptr, indptr, last = host
    return PagedKVLayout(qo_indptr, indptr, indices, last)


class GraphLayout:
    """Fixed-capacity layout buffers for decode steps replayed from CUDA graphs: up to ``max_rows`` rows of up to
    ``max_blocks`` pages.

    :meth:`buffers` gives the ``(kv_indptr, kv_indices, kv_last_page_len)`` of a batch of ``rows`` rows, views
    at the start of the same storage for every batch size: one graph replays at a time and each replay rewrites
    what it reads. :meth:`refresh` rewrites them from a static batch's device tensors (its ``seq_lens`` and
    ``block_tables``), in place and without a sync, so it is captured with the step and runs in every replay;
    padding rows (``seq_lens`` 0) get no page.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.kv_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max_rows * max_blocks, dtype=torch.int32, device=device)
        self.kv_last_page_len = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.max_rows and width <= self.max_blocks

    def buffers(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_indptr[: rows + 1], self.kv_indices[: rows * width], self.kv_last_page_len[:rows]

    def refresh(self, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> None:
        indptr, indices, last = self.buffers(*block_tables.shape)
        kv_indptr(seq_lens, block_size, out=indptr)
        kv_last_page_len(seq_lens, block_size, out=last)
        kv_indices(block_tables, indptr, out=indices)


def paged_kv_views(
    kv_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """What FlashInfer's ``run()`` reads of one layer's cache: ``(k_cache, v_cache, kv_cache_sf)``, no copy.

    The keys and values are ``[num_pages, page_size, num_kv_heads, head_dim]`` (``NHD``). ``kv_cache_sf`` is
    ``None`` for a cache in the model's dtype; for the FP8 cache (``nanovllm_attention_flash.fp8_cache``: e4m3
    values in that same layout, one float32 scale per token and KV head, value = e4m3 * scale) it is the
    ``(k_scales, v_scales)`` that FlashInfer's per-(token, head) scale path (``use_token_head_sf``) takes: views
    ``[num_pages, page_size, num_kv_heads]`` of the cache's ``[num_blocks, num_kv_heads, block_size]`` scales,
    transposed (FlashInfer reads their strides).
    """
    if not is_fp8_cache(kv_cache):
        return kv_cache[0], kv_cache[1], None
    values, scales = fp8_views(kv_cache, block_size, num_kv_heads, head_dim)
    return values[0], values[1], (scales[0].transpose(1, 2), scales[1].transpose(1, 2))
