"""Runs the model on one device: builds it, owns the KV cache, turns a scheduled batch into tensors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.cuda_graph import CudaGraphDecoder
from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import ConfigError
from nanovllm_core.forward_context import forward_context
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch, SchedulerOutput
from nanovllm_core.layers.attention import Attention
from nanovllm_core.layers.fused import set_compile
from nanovllm_core.layers.sampler import Sampler, SamplingBatch
from nanovllm_core.loader import iter_safetensors
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence

logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    logits_indices: torch.Tensor  # which flattened tokens produce logits
    sample_rows: list[int]  # batch index of each logits row


def model_shape(hf_config: Any) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) of a decoder config."""
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return hf_config.num_hidden_layers, num_heads, num_kv_heads, head_dim


@dataclass
class HostBatch:
    """One step's model inputs as plain lists: built once on rank 0, sent as is to tensor-parallel workers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    max_blocks: int
    max_query_len: int
    logits_indices: list[int]
    sample_rows: list[int]
    block_tables: list[int] = field(default_factory=list)  # flattened [num_seqs, max_blocks], padded with 0
    # async scheduling: input_ids[placeholder_dst[i]] is row placeholder_src[i] of the previous step's tokens
    placeholder_dst: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)


def _flatten_decode(seqs: list[Sequence], bs: int) -> tuple[HostBatch, list[tuple[int, int]]]:
    """Pure decode, the common case, kept cheap."""
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
    seq_lens = [p + 1 for p in positions]
    sample_rows = [i for i, (seq, n) in enumerate(zip(seqs, seq_lens)) if n == len(seq.token_ids)]
    host = HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=[seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)],
        query_start_loc=list(range(len(seqs) + 1)),
        seq_lens=seq_lens,
        max_blocks=max(map(len, (seq.block_table for seq in seqs))),
        max_query_len=1,
        logits_indices=sample_rows,
        sample_rows=sample_rows,
    )
    return host, [(i, i) for i, token in enumerate(input_ids) if token == PLACEHOLDER_TOKEN]


def _flatten_mixed(batch: SchedulerOutput, bs: int) -> tuple[HostBatch, list[tuple[int, int]]]:
    host = HostBatch([], [], [], [0], [], 0, max(batch.num_new_tokens), [], [])
    input_ids, positions, slots = host.input_ids, host.positions, host.slot_mapping
    query_start_loc = host.query_start_loc
    placeholder_rows: list[tuple[int, int]] = []  # (flat index, batch row) of tokens still on the device
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        if n == 1:
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = table[pos // bs] * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + block_end))
                pos = block_end
        query_start_loc.append(query_start_loc[-1] + n)
        host.seq_lens.append(end)
        if len(table) > host.max_blocks:
            host.max_blocks = len(table)
        if end == seq.num_tokens:
            host.logits_indices.append(query_start_loc[-1] - 1)
            host.sample_rows.append(row)
            if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                placeholder_rows.append((query_start_loc[-1] - 1, row))
    return host, placeholder_rows


def flatten_batch(batch: SchedulerOutput, block_size: int, previous_rows: dict[int, int] | None = None) -> HostBatch:
    """Flatten a scheduled batch into token ids, positions, KV slots and block tables (host work).

    ``previous_rows`` maps ``seq_id`` to the row of the in-flight step's sampled tokens (async scheduling): a
    sequence whose last token is still :data:`PLACEHOLDER_TOKEN` takes its input from there, on the device.
    """
    seqs = batch.seqs
    if max(batch.num_new_tokens) == 1:
        host, placeholder_rows = _flatten_decode(seqs, block_size)
    else:
        host, placeholder_rows = _flatten_mixed(batch, block_size)
    if placeholder_rows:
        if previous_rows is None:
            raise RuntimeError("a scheduled token is a placeholder but no step is in flight to supply it")
        host.placeholder_dst = [dst for dst, _ in placeholder_rows]
        host.placeholder_src = [previous_rows[seqs[row].seq_id] for _, row in placeholder_rows]
    flat_tables = host.block_tables
    zeros = [0] * host.max_blocks
    for seq in seqs:
        flat_tables.extend(seq.block_table)
        flat_tables.extend(zeros[len(seq.block_table) :])
    return host


def to_model_inputs(
    host: HostBatch, block_size: int, device: torch.device, previous_tokens: torch.Tensor | None = None
) -> ModelInputs:
    num_seqs = len(host.seq_lens)
    attention = AttentionBatch(
        query_start_loc=host_tensor(host.query_start_loc, torch.int32, device),
        seq_lens=host_tensor(host.seq_lens, torch.int32, device),
        block_tables=host_tensor(host.block_tables, torch.int32, device).view(num_seqs, host.max_blocks),
        slot_mapping=host_tensor(host.slot_mapping, torch.int64, device),
        max_query_len=host.max_query_len,
        max_seq_len=max(host.seq_lens),
        num_seqs=num_seqs,
        num_tokens=len(host.input_ids),
        block_size=block_size,
        query_start_loc_cpu=host.query_start_loc,
        seq_lens_cpu=host.seq_lens,
    )
    input_ids = host_tensor(host.input_ids, torch.int64, device)
    if host.placeholder_dst:
        assert previous_tokens is not None
        src = host_tensor(host.placeholder_src, torch.int64, device)
        input_ids.index_copy_(0, host_tensor(host.placeholder_dst, torch.int64, device), previous_tokens[src])
    return ModelInputs(
        input_ids=input_ids,
        positions=host_tensor(host.positions, torch.int64, device),
        attention=attention,
        logits_indices=host_tensor(host.logits_indices, torch.int64, device),
        sample_rows=host.sample_rows,
    )


def prepare_inputs(batch: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """``flatten_batch`` then the tensors on ``device``."""
    return to_model_inputs(flatten_batch(batch, block_size), block_size, device)


class PendingStep:
    """A launched step: its sampled tokens are on their way to the host (one copy, no sync until read)."""

    def __init__(self, batch: SchedulerOutput, sample_rows: list[int], token_tensor: torch.Tensor | None) -> None:
        self.batch = batch
        self.sample_rows = sample_rows
        self.token_tensor = token_tensor
        # where each sampled sequence's token sits in token_tensor, for the next step's placeholder inputs
        self.row_of_seq = {batch.seqs[row].seq_id: i for i, row in enumerate(sample_rows)}
        self._host = token_tensor
        self._copied: torch.cuda.Event | None = None
        if token_tensor is not None and token_tensor.is_cuda:
            self._host = torch.empty(token_tensor.shape, dtype=token_tensor.dtype, pin_memory=True)
            self._host.copy_(token_tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def tokens(self) -> list[int | None]:
        """The sampled token of each row of the batch, ``None`` for rows that sample nothing (waits for the
        device: the step's one synchronisation)."""
        sampled: list[int | None] = [None] * len(self.batch.seqs)
        if self._host is None:
            return sampled
        if self._copied is not None:
            self._copied.synchronize()
        for row, token in zip(self.sample_rows, self._host.tolist()):
            sampled[row] = token
        return sampled


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        model_cls: type[nn.Module],
        backend_cls: type[AttentionBackend],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.kvcache_block_size
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = model_shape(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = config.max_model_len
        set_compile(device.type == "cuda" and config.compile_small_ops)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = model_cls(hf_config)
        finally:
            torch.set_default_dtype(previous)
        self.model.load_weights(iter_safetensors(config.model))
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ConfigError(f"{model_cls.__name__} has no nanovllm_core.layers.Attention layer")
        first = self.attention_layers[0]
        self.backend = instantiate(
            "attention",
            backend_cls,
            config.plugins.attention_options,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            scale=first.scale,
            block_size=self.block_size,
            dtype=dtype,
            device=device,
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator, seed=config.seed)
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.graphs: CudaGraphDecoder | None = None
        if device.type == "cuda" and not config.enforce_eager and backend_cls.supports_cuda_graph:
            self.graphs = CudaGraphDecoder(
                self.model,
                self.backend,
                max_batch=min(config.max_num_seqs, 512),
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                hidden_size=hf_config.hidden_size,
                dtype=dtype,
                device=device,
            )
        self.host_prepare_s = 0.0
        self.num_steps = 0
        self.on_step: Callable[[HostBatch], None] | None = None  # tensor parallel: tell the workers
        self.track_gpu_time = False
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # --- KV cache -------------------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_block = 2 * self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_block * len(self.attention_layers)

    def _num_blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            self._profile_run()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            peak = torch.cuda.memory_stats(self.device)["allocated_bytes.all.peak"]
            current = torch.cuda.memory_stats(self.device)["allocated_bytes.all.current"]
            budget = total * self.config.gpu_memory_utilization - used - peak + current
            if budget <= 0:
                raise ConfigError(
                    f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no memory for the KV "
                    f"cache ({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB); raise it or use a smaller model"
                )
            return int(budget // self.kv_block_bytes())
        return int(self.config.cpu_kvcache_gib * 2**30 // self.kv_block_bytes())

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.config.num_kvcache_blocks or self._num_blocks_from_memory()
        if dist.is_initialized():  # every rank must hold the same number of blocks
            count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ConfigError("the KV cache would hold no block; set num_kvcache_blocks or give it more memory")
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads_local, self.head_dim)
        # zeros, not empty: a kernel may read a whole last block, and NaN garbage times a zero weight is NaN
        self.kv_cache = torch.zeros((len(self.attention_layers), *shape), dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.kv_cache = self.kv_cache[i]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.dtype.itemsize / 2**30,
        )
        return num_blocks

    @property
    def num_kv_heads_local(self) -> int:
        return self.attention_layers[0].num_kv_heads

    def _profile_run(self) -> None:
        """One forward over ``max_num_batched_tokens`` tokens into a scratch cache, to measure the peak."""
        n = min(self.config.max_num_batched_tokens, (self.max_model_len - 1) * self.config.max_num_seqs)
        num_seqs = max(1, min(self.config.max_num_seqs, -(-n // (self.max_model_len - 1))))
        lens = [n // num_seqs] * num_seqs
        lens[-1] += n - sum(lens)
        bs = self.block_size
        blocks_per_seq = [-(-length // bs) for length in lens]
        scratch = torch.zeros(
            self.backend.kv_cache_shape(sum(blocks_per_seq), bs, self.num_kv_heads_local, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        for layer in self.attention_layers:
            layer.kv_cache = scratch
        tables, slots, first = [], [], 0
        for length, nb in zip(lens, blocks_per_seq):
            tables.append(list(range(first, first + nb)) + [0] * (max(blocks_per_seq) - nb))
            slots.extend(range(first * bs, first * bs + length))
            first += nb
        qsl = [0]
        for length in lens:
            qsl.append(qsl[-1] + length)
        dev = self.device
        batch = AttentionBatch(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            num_seqs=num_seqs,
            num_tokens=n,
            block_size=bs,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        torch.cuda.reset_peak_memory_stats(dev)
        input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(length, device=dev) for length in lens])
        with torch.inference_mode(), forward_context(self.backend, self.backend.build_metadata(batch)):
            hidden = self.model(input_ids, positions)
            self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=dev) - 1])
        torch.cuda.synchronize(dev)
        del scratch, hidden

    # --- one step -------------------------------------------------------------------------------------

    def prepare(self, batch: SchedulerOutput) -> ModelInputs:
        return prepare_inputs(batch, self.block_size, self.device)

    @torch.inference_mode()
    def compute_logits(self, inputs: ModelInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.attention):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
            return self.model.compute_logits(hidden[inputs.logits_indices])
        metadata = self.backend.build_metadata(inputs.attention)
        with forward_context(self.backend, metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)
            return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def run_step(self, host: HostBatch) -> None:
        """A tensor-parallel worker's step: the same forward as rank 0, nothing sampled."""
        self.compute_logits(to_model_inputs(host, self.block_size, self.device))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput, in_flight: PendingStep | None = None) -> PendingStep:
        """Queue one step on the device and return without waiting for it.

        ``in_flight`` is the step launched before this one whose tokens the host has not read yet (async
        scheduling): tokens of ``batch`` that are still placeholders are taken from it on the device.
        """
        t0 = time.perf_counter()
        host = flatten_batch(batch, self.block_size, in_flight.row_of_seq if in_flight is not None else None)
        if self.on_step is not None:
            self.on_step(host)
        previous = in_flight.token_tensor if in_flight is not None else None
        inputs = to_model_inputs(host, self.block_size, self.device, previous)
        self.host_prepare_s += time.perf_counter() - t0
        self.num_steps += 1
        events = None
        if self.track_gpu_time and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
            self._step_events.append(events)
        logits = self.compute_logits(inputs)
        token_tensor = None
        if inputs.sample_rows:
            seqs: list[Sequence] = [batch.seqs[r] for r in inputs.sample_rows]
            token_tensor = self.sampler(logits, SamplingBatch.from_seqs(seqs, self.vocab_size, self.device))
        if events is not None:
            events[1].record()
        return PendingStep(batch, inputs.sample_rows, token_tensor)

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Run one step; returns the sampled token for each sequence of ``batch`` (``None`` mid-prompt)."""
        return self.launch(batch).tokens()

    def timing_summary(self) -> dict[str, float]:
        """Host time spent turning batches into tensors; with ``track_gpu_time``, GPU busy and idle time
        (idle: from the end of one step's last kernel to the start of the next step's first)."""
        summary = {
            "steps": self.num_steps,
            "host_prepare_s": self.host_prepare_s,
            "host_prepare_ms_per_step": 1e3 * self.host_prepare_s / max(self.num_steps, 1),
        }
        if self._step_events:
            torch.cuda.synchronize(self.device)
            busy = sum(start.elapsed_time(end) for start, end in self._step_events) / 1e3
            idle = (
                sum(prev[1].elapsed_time(cur[0]) for prev, cur in zip(self._step_events, self._step_events[1:])) / 1e3
            )
            summary.update(gpu_busy_s=busy, gpu_idle_s=idle, gpu_idle_fraction=idle / max(busy + idle, 1e-9))
        return summary
