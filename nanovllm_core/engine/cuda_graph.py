"""Steps replayed from CUDA graphs: decode steps per batch-size bucket, steps with prompt tokens per token bucket.

A step launches hundreds of small kernels; capturing them once per bucket and replaying removes the launch
cost, which is most of an eager decode step of a small model. The graphs read every input from static buffers: a
step copies its inputs into them, pads them up to the bucket size (padding rows: query length 0, context 0, nothing
attended; padding tokens: slot -1, nothing stored, their hidden rows garbage the runner never reads), and replays.
``CudaGraphDecoder`` replays pure-decode steps (one new token per sequence), one graph per batch size; backends
opt in with ``supports_cuda_graph``, and their ``build_metadata``, called once per bucket on the static buffers,
must keep only references to them (anything that depends on the values is computed inside ``forward``, hence
inside the graph). ``CudaGraphMixed`` replays steps that carry prompt tokens (prefill chunks, alone or beside
decode tokens: what a mixed-batch scheduler runs in most steps under load) of up to ``max_tokens`` tokens, one
graph per token-count bucket over ``max_seqs`` sequence rows; backends opt in with ``supports_cuda_graph_mixed``
and build its metadata with ``build_graph_metadata``.

Under tensor parallelism every rank captures its own graphs, and the layers' all-reduces (NCCL, or the
symmetric-memory kernels of :mod:`nanovllm_core.distributed`) are captured inside them: a decode step replays
the whole forward, communication included, with no Python in between.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import torch
from torch import nn

from nanovllm_core.distributed import get_tp_size
from nanovllm_core.forward_context import forward_context
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch


def capture_graphs(
    model: nn.Module,
    backend: AttentionBackend,
    buckets: list[tuple[int, int, Any]],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    pool: Any = None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], Any]:
    """One graph per ``(key, num_tokens, metadata)`` bucket, largest first, all in one memory pool (``pool``, or a
    new one): the model over the first ``num_tokens`` rows of the static buffers, into ``hidden``."""
    # Tensor parallel: the warm-up's collectives leave work that NCCL's watchdog thread polls with event
    # queries, which a process-wide ("global") capture forbids from any thread; capture in this thread's
    # mode only, after the warm-up has finished on the device. Every rank captures the same sizes in the
    # same order, so the collectives inside the graphs pair up when the ranks replay the same step.
    distributed = get_tp_size() > 1
    mode = "thread_local" if distributed else "global"
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    for key, n, metadata in buckets:
        with forward_context(backend, metadata):
            hidden[:n] = model(input_ids[:n], positions[:n])  # warm-up
            if distributed:
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool, capture_error_mode=mode):
                hidden[:n] = model(input_ids[:n], positions[:n])
        if pool is None:
            pool = graph.pool()
        graphs[key] = graph
        torch.cuda.synchronize()
    return graphs, pool


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets of the mixed-step graphs: powers of two to 256, then every 128 up to ``max_tokens``."""
    sizes = [t for t in (16, 32, 64, 128, 256) if t < max_tokens] + list(range(384, max_tokens + 1, 128))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class MixedStepBuffers:
    """The static inputs of the mixed-step graphs: ``max_seqs`` sequence rows and ``max_tokens`` tokens, and how
    a step is copied into them (device-agnostic: the CPU tests run the kernels on them in Triton's interpreter).

    ``decode``: the decode graphs' instead, one token per row, bucketed by batch size (``graph_batch_sizes``): a
    bucket of ``bs`` rows uses the first ``bs``.
    """

    def __init__(
        self,
        max_seqs: int,
        max_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        decode: bool = False,
    ) -> None:
        self.decode = decode
        self.sizes = graph_batch_sizes(max_seqs) if decode else mixed_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = self.max_tokens if decode else max_seqs
        self.max_blocks = -(-max_model_len // block_size)
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        # every row and token is padding until a step copies its own in: no sequence owns a token
        self.batch = AttentionBatch.build(
            query_start_loc=list(range(n + 1)) if decode else [0] * (max_seqs + 1),
            seq_lens=[0] * self.max_seqs,
            block_tables=torch.zeros((self.max_seqs, self.max_blocks), dtype=torch.int32, device=device),
            slot_mapping=[-1] * n,
            block_size=block_size,
            device=device,
            max_query_len=1 if decode else n,
            max_seq_len=max_model_len,
        )

    def bucket(self, num_tokens: int) -> AttentionBatch:
        """The static batch of the ``num_tokens`` bucket: every sequence row (decode: the first ``num_tokens``),
        the first ``num_tokens`` slots."""
        if self.decode:
            return self.batch.head(num_tokens)
        slots = self.batch.slot_mapping[:num_tokens]
        return dataclasses.replace(self.batch, slot_mapping=slots, num_tokens=num_tokens, max_query_len=num_tokens)

    def can_run(self, batch: AttentionBatch) -> bool:
        if self.decode:
            return batch.max_query_len == 1 and batch.num_seqs <= self.max_seqs
        return (
            batch.max_query_len > 1
            and batch.num_tokens <= self.max_tokens
            and batch.num_seqs <= self.max_seqs
            and batch.block_tables.size(1) <= self.max_blocks
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> int:
        """Copy the step into the static buffers, padding up to its bucket; returns the bucket (no sync)."""
        n, rows = batch.num_tokens, batch.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        static = self.batch
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        static.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        static.seq_lens[:rows].copy_(batch.seq_lens, non_blocking=True)
        static.block_tables[:rows, : batch.block_tables.size(1)].copy_(batch.block_tables, non_blocking=True)
        if self.decode:  # rows past the step's in its bucket: no slot, no context
            if size > n:
                static.slot_mapping[n:size].fill_(-1)
                static.seq_lens[n:size].zero_()
            return size
        static.slot_mapping[n:size].fill_(-1)
        static.query_start_loc[: rows + 1].copy_(batch.query_start_loc, non_blocking=True)
        static.query_start_loc[rows + 1 :].fill_(n)
        static.seq_lens[rows:].zero_()
        return size


class CudaGraphMixed(MixedStepBuffers):
    """Steps with prompt tokens of up to ``max_tokens`` tokens over up to ``max_seqs`` sequences, from graphs
    (``decode``: pure-decode steps, see :class:`CudaGraphDecoder`)."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_seqs: int,
        max_tokens: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        pool: Any = None,
        decode: bool = False,
    ) -> None:
        super().__init__(max_seqs, max_tokens, max_model_len, block_size, device, decode)
        self.hidden = torch.zeros((self.max_tokens, hidden_size), dtype=dtype, device=device)
        self.num_replays = 0  # steps run from a graph (tests and benchmarks read it)
        build = backend.build_metadata if decode else backend.build_graph_metadata
        with torch.inference_mode():
            buckets = [(t, t, build(self.bucket(t))) for t in reversed(self.sizes)]
            self.graphs, self.pool = capture_graphs(
                model, backend, buckets, self.input_ids, self.positions, self.hidden, pool
            )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        self.graphs[self.load(input_ids, positions, batch)].replay()
        self.num_replays += 1
        return self.hidden[: batch.num_tokens]


class CudaGraphDecoder(CudaGraphMixed):
    """Pure-decode steps (one new token per sequence), one graph per batch size up to ``max_batch``."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(model, backend, max_batch, max_batch, max_model_len, block_size, hidden_size, dtype, device,
                         decode=True)  # fmt: skip


def capture_cuda_graphs(
    model: nn.Module,
    backend: AttentionBackend,
    config: Any,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[CudaGraphDecoder | None, CudaGraphMixed | None]:
    """The graphs ``config`` (an ``EngineConfig``) and the backend allow: decode steps on CUDA unless
    ``enforce_eager``, and steps with prompt tokens up to ``cuda_graph_max_mixed_tokens`` where the backend
    opts in (both share one memory pool)."""
    if device.type != "cuda" or config.enforce_eager or not backend.supports_cuda_graph:
        return None, None
    shape = dict(max_model_len=config.max_model_len, block_size=config.kvcache_block_size, hidden_size=hidden_size,
                 dtype=dtype, device=device)  # fmt: skip
    graphs = CudaGraphDecoder(model, backend, max_batch=min(config.max_num_seqs, 512), **shape)
    mixed_tokens = min(config.cuda_graph_max_mixed_tokens, config.max_num_batched_tokens)
    if mixed_tokens <= 1 or not backend.supports_cuda_graph_mixed:
        return graphs, None
    return graphs, CudaGraphMixed(model, backend, graphs.max_seqs, mixed_tokens, pool=graphs.pool, **shape)
