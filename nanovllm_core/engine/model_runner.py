"""Runs the model on one device: the coordinator of a step. It builds the model and the attention backend,
sizes the KV cache (``kv_cache``), captures CUDA graphs (``cuda_graph``), turns a scheduled batch into tensors
(``input_batch``), runs the forward and samples (``layers.sampler``, with each request's persistent sampling
state), and hands back a :class:`~nanovllm_core.engine.sampling.PendingStep`."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.cuda_graph import capture_cuda_graphs
from nanovllm_core.engine.input_batch import (
    HostBatch,
    InputBatch,
    ModelInputs,
    flatten_batch,
    one_token_rows,
    plan_prompt_logprobs,
    prepare_inputs,
    prompt_pairs,
    to_model_inputs,
)
from nanovllm_core.engine.kv_cache import allocate_kv_cache, kv_block_bytes, model_shape
from nanovllm_core.engine.options import instantiate
from nanovllm_core.engine.sampling import LOGPROBS_SLICE, PendingStep, sample_logprobs, score_prompts
from nanovllm_core.errors import ConfigError
from nanovllm_core.forward_context import forward_context
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.interfaces import AttentionBackend, SchedulerOutput
from nanovllm_core.layers.attention import Attention
from nanovllm_core.layers.fused import set_compile
from nanovllm_core.layers.linear import process_weights_after_loading, quantize_model
from nanovllm_core.layers.sampler import Sampler
from nanovllm_core.layers.token_bitmask import apply_token_bitmask
from nanovllm_core.layers.triton_jit import set_pdl
from nanovllm_core.loader import checkpoint_quantization_config, iter_safetensors
from nanovllm_core.plugins import get_registry
from nanovllm_core.sequence import Sequence

logger = logging.getLogger(__name__)


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
        set_pdl(device.type == "cuda" and config.programmatic_dependent_launch)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = model_cls(hf_config)
        finally:
            torch.set_default_dtype(previous)
        if config.quantization is not None:  # named (and checked) by the engine: select_quantization
            method_cls = get_registry().get("quantization", config.quantization).obj
            quantize_model(self.model, method_cls(checkpoint_quantization_config(hf_config)))
        self.model.load_weights(iter_safetensors(config.model))
        process_weights_after_loading(self.model)
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
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed), seed=config.seed)
        self.input_batch = InputBatch(self.vocab_size, device)
        self.kv_cache, self.num_kvcache_blocks = allocate_kv_cache(self)
        self.backend.warmup(self.attention_layers[0].kv_cache)  # compile every attention kernel variant now
        started = time.perf_counter()
        self.graphs, self.mixed_graphs = capture_cuda_graphs(
            self.model, self.backend, config, hf_config.hidden_size, dtype, device
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
        # with track_gpu_time, per step: its start and end events and its shape (see step_records)
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, tuple[int, int, int, float, int, int]]] = []

    kv_block_bytes = kv_block_bytes

    @property
    def num_kv_heads_local(self) -> int:
        return self.attention_layers[0].num_kv_heads

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

    @torch.inference_mode()
    def launch(
        self,
        batch: SchedulerOutput,
        in_flight: PendingStep | None = None,
        before_sample: Callable[[], tuple[list[int], torch.Tensor]] | None = None,
    ) -> PendingStep:
        """Queue one step on the device and return without waiting for it.

        ``in_flight`` is the step launched before this one whose tokens the host has not read yet (async
        scheduling): tokens of ``batch`` that are still placeholders are taken from it on the device.
        ``before_sample``: called once the forward is queued, before sampling; returns the structured-output
        bitmask (rows of ``batch``, int32 bitmask) to apply, in place of ``batch.grammar_bitmask``, so that the host
        fills it while the device runs the forward.
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
            lens = host.seq_lens
            shape = (len(lens), len(host.input_ids), sum(lens), prompt_pairs(host), max(lens), one_token_rows(host))
            self._step_events.append((*events, shape))
        logits, hidden = self._forward(inputs)
        grammar_bitmask = before_sample() if before_sample is not None else batch.grammar_bitmask
        if grammar_bitmask is not None:  # structured output: forbidden tokens to -inf, one kernel
            rows, bitmask = grammar_bitmask
            position = {row: i for i, row in enumerate(inputs.sample_rows)}
            apply_token_bitmask(logits, bitmask, [position[row] for row in rows])
        token_tensor = sample_lps = prompt_logprobs = embeddings = None
        if inputs.sample_rows:
            seqs: list[Sequence] = [batch.seqs[r] for r in inputs.sample_rows]
            sampling = self.input_batch.sampling_batch(seqs)
            token_tensor = self.sampler(logits, sampling)
            if sampling.penalties is not None:
                sampling.penalties.record(token_tensor)
            if sampling.num_logprobs is not None:
                sample_lps = sample_logprobs(logits, token_tensor, sampling.num_logprobs, inputs.sample_rows)
            embed_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.embed]
            if embed_rows:  # last-token pooling: the hidden state that gave this step's logits
                pooled = hidden[inputs.logits_indices[host_tensor(embed_rows, torch.int64, self.device)]]
                embeddings = ([inputs.sample_rows[i] for i in embed_rows],
                              torch.nn.functional.normalize(pooled.float(), dim=-1))  # fmt: skip
        if plan is not None:
            prompt_logprobs = score_prompts(self._prompt_logits(hidden, inputs), plan, self.device)
        if events is not None:
            events[1].record()
        positions = dict(zip(plan.rows, plan.first_positions)) if plan is not None else None
        return PendingStep(batch, inputs.sample_rows, token_tensor, sample_lps, prompt_logprobs, positions, embeddings)

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
        events = self._step_events
        if events:
            torch.cuda.synchronize(self.device)
            busy = sum(start.elapsed_time(end) for start, end, _ in events) / 1e3
            idle = sum(prev[1].elapsed_time(cur[0]) for prev, cur in zip(events, events[1:])) / 1e3
            summary.update(gpu_busy_s=busy, gpu_idle_s=idle, gpu_idle_fraction=idle / max(busy + idle, 1e-9))
        return summary

    def step_records(self) -> list[tuple[int, int, int, float, float, int, int]]:
        """With ``track_gpu_time``: each tracked step's (sequences, query tokens, KV tokens attended, GPU ms, query-key
        pairs of its prompt chunks' causal attention, the longest sequence's KV tokens, rows of one query token)."""
        if not self._step_events:
            return []
        torch.cuda.synchronize(self.device)
        return [(s, q, k, start.elapsed_time(end), *rest) for start, end, (s, q, k, *rest) in self._step_events]

    def reset_step_tracking(self) -> None:
        self.num_steps, self.host_prepare_s = 0, 0.0
        self._step_events.clear()
