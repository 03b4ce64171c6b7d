"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A pure-decode step (one new token per sequence) launches hundreds of small kernels; capturing them once
per batch size and replaying removes the launch cost. The graphs read every input from static buffers:
a step copies its inputs into them, pads the rows up to the bucket size (slot -1: nothing stored; sequence
length 0: nothing attended), and replays. Backends opt in with ``supports_cuda_graph``; their
``build_metadata`` is called once per bucket on the static buffers and must keep only references to them
(anything that depends on the values is computed inside ``forward``, hence inside the graph).

Under tensor parallelism every rank captures its own graphs, and the layers' all-reduces (NCCL, or the
symmetric-memory kernels of :mod:`nanovllm_core.distributed`) are captured inside them: a decode step replays
the whole forward, communication included, with no Python in between.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from nanovllm_core.distributed import get_tp_size
from nanovllm_core.forward_context import forward_context
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphDecoder:
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
        self.model = model
        self.backend = backend
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        # every row is padding until a step copies its own in; a bucket of bs rows uses the first bs
        self.batch = AttentionBatch.build(
            query_start_loc=list(range(n + 1)),
            seq_lens=[0] * n,
            block_tables=torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device),
            slot_mapping=[-1] * n,
            block_size=block_size,
            device=device,
            max_query_len=1,
            max_seq_len=max_model_len,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # decode steps run from a graph (tests and benchmarks read it)
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Tensor parallel: the warm-up's collectives leave work that NCCL's watchdog thread polls with event
        # queries, which a process-wide ("global") capture forbids from any thread; capture in this thread's
        # mode only, after the warm-up has finished on the device. Every rank captures the same sizes in the
        # same order, so the collectives inside the graphs pair up when the ranks replay the same step.
        distributed = get_tp_size() > 1
        mode = "thread_local" if distributed else "global"
        for bs in reversed(self.sizes):
            metadata = self.backend.build_metadata(self.batch.head(bs))
            with forward_context(self.backend, metadata):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up
                if distributed:
                    torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool, capture_error_mode=mode):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def can_run(self, batch: AttentionBatch) -> bool:
        return batch.max_query_len == 1 and batch.num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        n = batch.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        static = self.batch
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        static.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        static.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        static.block_tables[:n, : batch.block_tables.size(1)].copy_(batch.block_tables, non_blocking=True)
        if bs > n:
            static.slot_mapping[n:bs].fill_(-1)
            static.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.hidden[:n]
