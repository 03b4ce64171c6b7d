"""Runs the model on one device: builds it, owns the KV cache, turns a scheduled batch into tensors."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanovllm_core.config import EngineConfig
from nanovllm_core.distributed import all_reduce, broadcast_from_first, get_tp_rank
from nanovllm_core.engine.cuda_graph import CudaGraphDecoder, CudaGraphMixed
from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import ConfigError
from nanovllm_core.forward_context import forward_context
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch, SchedulerOutput
from nanovllm_core.layers.attention import Attention
from nanovllm_core.layers.fused import set_compile
from nanovllm_core.layers.sampler import (
    LogprobsTensors,
    SampleLogprobs,
    Sampler,
    SamplingBatch,
    compute_logprobs,
)
from nanovllm_core.loader import iter_safetensors
from nanovllm_core.sampling_params import MAX_LOGPROBS
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence

logger = logging.getLogger(__name__)

LOGPROBS_SLICE = 256  # logprobs are computed this many rows at a time: a [rows, vocab] float32 each


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    logits_indices: torch.Tensor  # which flattened tokens produce logits
    sample_rows: list[int]  # batch index of each logits row
    prompt_logits_indices: torch.Tensor | None = None  # flattened tokens whose logits score the next prompt token


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
    # prompt_logprobs: flattened tokens whose logits give the logprob of the prompt token after them
    prompt_logits_indices: list[int] = field(default_factory=list)


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


@dataclass
class PromptLogprobsPlan:
    """The prompt positions one step scores, for the rows whose request asks ``prompt_logprobs``.

    Row ``rows[i]`` scores prompt tokens ``first_positions[i] .. first_positions[i] + counts[i] - 1`` (each
    given the tokens before it) and keeps ``num_top[i]`` top tokens; ``targets`` are those prompt tokens, all
    rows concatenated, in the order of ``HostBatch.prompt_logits_indices``.
    """

    rows: list[int] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)


def plan_prompt_logprobs(batch: SchedulerOutput, host: HostBatch) -> PromptLogprobsPlan | None:
    """Which prompt tokens this step can score, and the flattened tokens whose logits score them (appended to
    ``host.prompt_logits_indices``); ``None`` when no row asks (the common case, found without a pass in
    decode steps).

    A row computing positions ``[start, end)`` has the logits of position ``q`` for the token at ``q + 1``:
    it scores prompt tokens ``start + 1 .. min(end, num_prompt_tokens - 1)``. Over the chunks of a prompt that
    covers every prompt token but the first, provided the first chunk starts at 0 (no prefix-cache hit).
    """
    if host.max_query_len == 1 and len(host.sample_rows) == len(batch.seqs):
        return None  # every row computes its last token: no prompt token is left to score
    plan = None
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        num_top = seq.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        start = seq.num_computed_tokens
        last = min(start + n, seq.num_prompt_tokens - 1)
        if last <= start:
            continue
        plan = plan or PromptLogprobsPlan()
        plan.rows.append(row)
        plan.first_positions.append(start + 1)
        plan.counts.append(last - start)
        plan.num_top.append(num_top)
        plan.targets += seq.token_ids[start + 1 : last + 1]
        flat = host.query_start_loc[row]
        host.prompt_logits_indices += range(flat, flat + last - start)
    return plan


def to_model_inputs(
    host: HostBatch, block_size: int, device: torch.device, previous_tokens: torch.Tensor | None = None
) -> ModelInputs:
    attention = AttentionBatch.build(
        host.query_start_loc,
        host.seq_lens,
        host_tensor(host.block_tables, torch.int32, device).view(len(host.seq_lens), host.max_blocks),
        host.slot_mapping,
        block_size,
        device,
        max_query_len=host.max_query_len,
    )
    input_ids = host_tensor(host.input_ids, torch.int64, device)
    if host.placeholder_dst:
        dst = host_tensor(host.placeholder_dst, torch.int64, device)
        if previous_tokens is not None:
            tokens = previous_tokens[host_tensor(host.placeholder_src, torch.int64, device)]
        elif get_tp_rank() > 0:  # a tensor-parallel worker: only rank 0 samples; its tokens come below
            tokens = torch.empty(len(host.placeholder_dst), dtype=torch.int64, device=device)
        else:
            raise RuntimeError("the step has placeholder tokens but no previous step's sampled tokens were given")
        # async scheduling under tensor parallelism: every rank needs the in-flight step's tokens, which exist
        # only on rank 0's device; one small device-side broadcast, ordered after the sampling (no host sync)
        broadcast_from_first(tokens)
        input_ids.index_copy_(0, dst, tokens)
    return ModelInputs(
        input_ids=input_ids,
        positions=host_tensor(host.positions, torch.int64, device),
        attention=attention,
        logits_indices=host_tensor(host.logits_indices, torch.int64, device),
        sample_rows=host.sample_rows,
        prompt_logits_indices=(
            host_tensor(host.prompt_logits_indices, torch.int64, device) if host.prompt_logits_indices else None
        ),
    )


def prepare_inputs(batch: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """``flatten_batch`` then the tensors on ``device``."""
    return to_model_inputs(flatten_batch(batch, block_size), block_size, device)


@dataclass
class RowsLogprobs:
    """Logprobs one step computed for some rows of its batch: ``counts[i]`` consecutive entries for row
    ``rows[i]`` (1 for a sampled token, one per prompt token scored), each keeping ``num_top[i]`` top tokens."""

    rows: list[int]
    counts: list[int]
    num_top: list[int]
    tensors: LogprobsTensors

    def per_row(self) -> dict[int, list[SampleLogprobs]]:
        entries = self.tensors.tolist([k for k, c in zip(self.num_top, self.counts) for _ in range(c)])
        out, i = {}, 0
        for row, count in zip(self.rows, self.counts):
            out[row] = entries[i : i + count]
            i += count
        return out


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PendingStep:
    """A launched step: its sampled tokens (and logprobs, where asked) are on their way to the host (copies
    queued at launch, one synchronisation when first read).

    ``wants_logprobs`` / ``wants_prompt_logprobs``: whether :meth:`logprobs` / :meth:`prompt_logprobs` have
    anything to return (some row's request asked). ``prompt_positions[row]`` is the prompt position of the first
    entry of ``prompt_logprobs()[row]``: the same positions come again if the sequence is recomputed after a
    preemption.
    """

    def __init__(
        self,
        batch: SchedulerOutput,
        sample_rows: list[int],
        token_tensor: torch.Tensor | None,
        sample_logprobs: RowsLogprobs | None = None,
        prompt_logprobs: RowsLogprobs | None = None,
        prompt_positions: dict[int, int] | None = None,
        embeddings: tuple[list[int], torch.Tensor] | None = None,
    ) -> None:
        self.batch = batch
        self.sample_rows = sample_rows
        self.token_tensor = token_tensor
        # where each sampled sequence's token sits in token_tensor, for the next step's placeholder inputs
        self.row_of_seq = {batch.seqs[row].seq_id: i for i, row in enumerate(sample_rows)}
        self.prompt_positions = prompt_positions or {}
        self.wants_logprobs = sample_logprobs is not None
        self.wants_prompt_logprobs = prompt_logprobs is not None
        self.wants_embeddings = embeddings is not None
        self._embeddings = embeddings  # (batch rows, float32 [rows, hidden]) of the rows whose requests embed
        self._host = token_tensor
        self._logprobs = (sample_logprobs, prompt_logprobs)
        self._copied: torch.cuda.Event | None = None
        outputs = [lp.tensors.logprobs for lp in self._logprobs if lp is not None]
        if token_tensor is not None:
            outputs.append(token_tensor)
        if outputs and outputs[0].is_cuda:
            if token_tensor is not None:
                self._host = _pinned_copy(token_tensor)
            for lp in self._logprobs:
                if lp is not None:
                    lp.tensors = lp.tensors.map(_pinned_copy)
            if embeddings is not None:
                self._embeddings = (embeddings[0], _pinned_copy(embeddings[1]))
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def tokens(self) -> list[int | None]:
        """The sampled token of each row of the batch, ``None`` for rows that sample nothing (waits for the
        device: the step's one synchronisation)."""
        sampled: list[int | None] = [None] * len(self.batch.seqs)
        if self._host is None:
            return sampled
        self._wait()
        for row, token in zip(self.sample_rows, self._host.tolist()):
            sampled[row] = token
        return sampled

    def logprobs(self) -> list[SampleLogprobs | None]:
        """The sampled token's logprobs for each row of the batch whose request asks ``logprobs``; ``None`` for
        the other rows and for rows that sample nothing."""
        out: list[SampleLogprobs | None] = [None] * len(self.batch.seqs)
        if self._logprobs[0] is not None:
            self._wait()
            for row, entries in self._logprobs[0].per_row().items():
                out[row] = entries[0]
        return out

    def embeddings(self) -> dict[int, list[float]]:
        """For each row whose request asks ``embed``: its last prompt token's final hidden state, L2-normalised."""
        if self._embeddings is None:
            return {}
        self._wait()
        rows, vectors = self._embeddings
        return dict(zip(rows, vectors.tolist()))

    def prompt_logprobs(self) -> dict[int, list[SampleLogprobs]]:
        """For each row whose request asks ``prompt_logprobs`` and whose chunk scored prompt tokens: one entry
        per prompt token from position ``prompt_positions[row]`` on, each given the tokens before it."""
        if self._logprobs[1] is None:
            return {}
        self._wait()
        return self._logprobs[1].per_row()


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
        self.backend.warmup(self.attention_layers[0].kv_cache)  # compile every attention kernel variant now
        self.graphs: CudaGraphDecoder | None = None
        started = time.perf_counter()
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
        self.mixed_graphs: CudaGraphMixed | None = None
        mixed_tokens = min(config.cuda_graph_max_mixed_tokens, config.max_num_batched_tokens)
        if self.graphs is not None and mixed_tokens > 1 and backend_cls.supports_cuda_graph_mixed:
            self.mixed_graphs = CudaGraphMixed(
                self.model,
                self.backend,
                max_seqs=self.graphs.max_batch,
                max_tokens=mixed_tokens,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                hidden_size=hf_config.hidden_size,
                dtype=dtype,
                device=device,
                pool=self.graphs.pool,
            )
        self.graph_capture_s = time.perf_counter() - started
        if device.type == "cuda":
            with torch.inference_mode():
                hidden = torch.zeros((1, hf_config.hidden_size), dtype=dtype, device=device)
                self.sampler.warmup(self.model.compute_logits(hidden))
        self.host_prepare_s = 0.0
        self.num_steps = 0
        self.on_step: Callable[[HostBatch], None] | None = None  # tensor parallel: tell the workers
        self.track_gpu_time = False
        # with track_gpu_time, per step: its start and end events and (sequences, query tokens, KV tokens attended)
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, tuple[int, int, int]]] = []

    # --- KV cache -------------------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        """Bytes one KV-cache block takes over all layers, in the backend's layout for ``kv_cache_dtype``."""
        shape, dtype = self.backend.kv_cache_spec(
            self.config.kv_cache_dtype, 1, self.block_size, self.num_kv_heads_local, self.head_dim, self.dtype
        )
        return torch.Size(shape).numel() * dtype.itemsize * len(self.attention_layers)

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
        kv_cache_dtype = self.config.kv_cache_dtype
        reason = self.backend.check_kv_cache_dtype(kv_cache_dtype, self.device)
        if reason is not None:
            from nanovllm_core.plugins import get_registry

            able = [
                r.name
                for r in get_registry().registrations["attention"].values()
                if r.obj.check_kv_cache_dtype(kv_cache_dtype, self.device) is None
                and r.obj.check_available(self.device, self.dtype, self.head_dim) is None
            ]
            raise ConfigError(
                f"attention backend {self.config.plugins.attention!r} ({type(self.backend).__name__}) cannot keep "
                f"the KV cache in kv_cache_dtype={kv_cache_dtype!r}: {reason}; backends that can here: "
                f"{', '.join(sorted(able)) or 'none'} (set plugins.attention), or use kv_cache_dtype='auto'"
            )
        num_blocks = self.config.num_kvcache_blocks or self._num_blocks_from_memory()
        if dist.is_initialized():  # every rank must hold the same number of blocks
            count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            all_reduce(count, op=dist.ReduceOp.MIN)  # a rank that failed to start is named, not a raw gloo error
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ConfigError("the KV cache would hold no block; set num_kvcache_blocks or give it more memory")
        shape, dtype = self.backend.kv_cache_spec(
            kv_cache_dtype, num_blocks, self.block_size, self.num_kv_heads_local, self.head_dim, self.dtype
        )
        # zeros, not empty: a kernel may read a whole last block, and NaN garbage times a zero weight is NaN
        self.kv_cache = torch.zeros((len(self.attention_layers), *shape), dtype=dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.kv_cache = self.kv_cache[i]
        logger.info(
            "KV cache: %d blocks of %d tokens, kv_cache_dtype=%s (%.2f GiB)",
            num_blocks,
            self.block_size,
            kv_cache_dtype,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )
        return num_blocks

    @property
    def num_kv_heads_local(self) -> int:
        return self.attention_layers[0].num_kv_heads

    def _profile_run(self) -> None:
        """One forward over ``max_num_batched_tokens`` tokens into a scratch cache, then logprobs over one slice
        of them (the most a step's logprobs hold at once), to measure the peak."""
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
        tables, first = [], 0
        for nb in blocks_per_seq:
            tables.append(list(range(first, first + nb)))
            first += nb
        dev = self.device
        batch = AttentionBatch.from_spans(tables, [(0, length) for length in lens], bs, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(length, device=dev) for length in lens])
        with torch.inference_mode(), forward_context(self.backend, self.backend.build_metadata(batch)):
            hidden = self.model(input_ids, positions)
            self.model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1])
            rows = hidden[:LOGPROBS_SLICE]
            compute_logprobs(self.model.compute_logits(rows), input_ids[: rows.size(0)], MAX_LOGPROBS)
        torch.cuda.synchronize(dev)
        del scratch, hidden

    # --- one step -------------------------------------------------------------------------------------

    def prepare(self, batch: SchedulerOutput) -> ModelInputs:
        return prepare_inputs(batch, self.block_size, self.device)

    def _forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over the step's tokens: (logits of the tokens that sample, hidden states of every token)."""
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None and graphs.can_run(inputs.attention):
                hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
                return self.model.compute_logits(hidden[inputs.logits_indices]), hidden
        metadata = self.backend.build_metadata(inputs.attention)
        with forward_context(self.backend, metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)
            return self.model.compute_logits(hidden[inputs.logits_indices]), hidden

    @torch.inference_mode()
    def compute_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits of the tokens that sample (``inputs.logits_indices``)."""
        return self._forward(inputs)[0]

    def _prompt_logits(self, hidden: torch.Tensor, inputs: ModelInputs) -> Iterator[torch.Tensor]:
        """Logits of the tokens that score prompt tokens, ``LOGPROBS_SLICE`` rows at a time (bounded memory).

        Taken right after the forward: with CUDA graphs ``hidden`` is a buffer that the next replay overwrites.
        """
        indices = inputs.prompt_logits_indices
        for i in range(0, 0 if indices is None else len(indices), LOGPROBS_SLICE):
            yield self.model.compute_logits(hidden[indices[i : i + LOGPROBS_SLICE]])

    @torch.inference_mode()
    def run_step(self, host: HostBatch) -> None:
        """A tensor-parallel worker's step: the same forward and logits as rank 0 (collectives included),
        nothing sampled."""
        inputs = to_model_inputs(host, self.block_size, self.device)
        _, hidden = self._forward(inputs)
        for _ in self._prompt_logits(hidden, inputs):
            pass

    def _sample_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None], sample_rows: list[int]
    ) -> RowsLogprobs:
        """Logprobs of the sampled tokens of the rows whose request asks ``logprobs`` (``logits``: raw)."""
        asked = [i for i, k in enumerate(num_logprobs) if k is not None]
        num_top = [k for k in num_logprobs if k is not None]
        if len(asked) < len(num_logprobs):
            index = host_tensor(asked, torch.int64, self.device)
            logits, tokens = logits[index], tokens[index]
        k, n = max(num_top), LOGPROBS_SLICE
        parts = [compute_logprobs(logits[i : i + n], tokens[i : i + n], k) for i in range(0, len(asked), n)]
        return RowsLogprobs([sample_rows[i] for i in asked], [1] * len(asked), num_top, LogprobsTensors.cat(parts))

    def _score_prompts(self, hidden: torch.Tensor, inputs: ModelInputs, plan: PromptLogprobsPlan) -> RowsLogprobs:
        targets = host_tensor(plan.targets, torch.int64, self.device)
        k, n = max(plan.num_top), LOGPROBS_SLICE
        parts = [
            compute_logprobs(logits, targets[i * n : (i + 1) * n], k)
            for i, logits in enumerate(self._prompt_logits(hidden, inputs))
        ]
        return RowsLogprobs(plan.rows, plan.counts, plan.num_top, LogprobsTensors.cat(parts))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput, in_flight: PendingStep | None = None) -> PendingStep:
        """Queue one step on the device and return without waiting for it.

        ``in_flight`` is the step launched before this one whose tokens the host has not read yet (async
        scheduling): tokens of ``batch`` that are still placeholders are taken from it on the device.
        """
        t0 = time.perf_counter()
        host = flatten_batch(batch, self.block_size, in_flight.row_of_seq if in_flight is not None else None)
        plan = plan_prompt_logprobs(batch, host)
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
            self._step_events.append((*events, (len(host.seq_lens), len(host.input_ids), sum(host.seq_lens))))
        logits, hidden = self._forward(inputs)
        token_tensor = sample_logprobs = prompt_logprobs = embeddings = None
        if inputs.sample_rows:
            seqs: list[Sequence] = [batch.seqs[r] for r in inputs.sample_rows]
            sampling = SamplingBatch.from_seqs(seqs, self.vocab_size, self.device)
            token_tensor = self.sampler(logits, sampling)
            if sampling.num_logprobs is not None:
                sample_logprobs = self._sample_logprobs(logits, token_tensor, sampling.num_logprobs, inputs.sample_rows)
            embed_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.embed]
            if embed_rows:  # last-token pooling: the hidden state that gave this step's logits
                pooled = hidden[inputs.logits_indices[host_tensor(embed_rows, torch.int64, self.device)]]
                embeddings = ([inputs.sample_rows[i] for i in embed_rows],
                              torch.nn.functional.normalize(pooled.float(), dim=-1))  # fmt: skip
        if plan is not None:
            prompt_logprobs = self._score_prompts(hidden, inputs, plan)
        if events is not None:
            events[1].record()
        positions = dict(zip(plan.rows, plan.first_positions)) if plan is not None else None
        return PendingStep(
            batch, inputs.sample_rows, token_tensor, sample_logprobs, prompt_logprobs, positions, embeddings
        )

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Run one step; returns the sampled token for each sequence of ``batch`` (``None`` mid-prompt)."""
        return self.launch(batch).tokens()

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs once the device is idle. Under tensor parallelism this comes before
        leaving the NCCL group: the abort of a communicator whose collectives live on in captured graphs hangs
        (pytorch/pytorch#115388; seen on two H200s as both ranks stuck in the abort). Best effort: on a failed
        device it logs why and returns, and shutdown goes on."""
        if self.graphs is None and self.mixed_graphs is None:
            return
        try:
            torch.cuda.synchronize(self.device)
            self.graphs = self.mixed_graphs = None
            gc.collect()  # a reference cycle may hold a graph: its executable goes with it
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - a failed device or worker: leaving the group goes on regardless
            logger.debug("releasing the CUDA graphs failed", exc_info=True)

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
            busy = sum(start.elapsed_time(end) for start, end, _ in self._step_events) / 1e3
            idle = (
                sum(prev[1].elapsed_time(cur[0]) for prev, cur in zip(self._step_events, self._step_events[1:])) / 1e3
            )
            summary.update(gpu_busy_s=busy, gpu_idle_s=idle, gpu_idle_fraction=idle / max(busy + idle, 1e-9))
        return summary

    def step_records(self) -> list[tuple[int, int, int, float]]:
        """With ``track_gpu_time``: each tracked step's (sequences, query tokens, KV tokens attended, GPU ms)."""
        if not self._step_events:
            return []
        torch.cuda.synchronize(self.device)
        return [(*shape, start.elapsed_time(end)) for start, end, shape in self._step_events]

    def reset_step_tracking(self) -> None:
        self.num_steps, self.host_prepare_s = 0, 0.0
        self._step_events.clear()
