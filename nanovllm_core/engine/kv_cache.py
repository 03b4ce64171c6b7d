"""KV-cache sizing and allocation: how many blocks fit (a profiling forward measures the activation peak on a
GPU), one tensor for every layer in the backend's layout, each ``Attention`` layer given its slice."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanovllm_core.distributed import all_reduce
from nanovllm_core.engine.sampling import LOGPROBS_SLICE
from nanovllm_core.errors import ConfigError
from nanovllm_core.forward_context import forward_context
from nanovllm_core.interfaces import AttentionBatch
from nanovllm_core.layers.sampler import compute_logprobs
from nanovllm_core.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from nanovllm_core.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def model_shape(hf_config: Any) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) of a decoder config."""
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return hf_config.num_hidden_layers, num_heads, num_kv_heads, head_dim


def kv_block_bytes(runner: ModelRunner) -> int:
    """Bytes one KV-cache block takes over all layers, in the backend's layout for ``kv_cache_dtype``."""
    shape, dtype = runner.backend.kv_cache_spec(
        runner.config.kv_cache_dtype, 1, runner.block_size, runner.num_kv_heads_local, runner.head_dim, runner.dtype
    )
    return torch.Size(shape).numel() * dtype.itemsize * len(runner.attention_layers)


def allocate_kv_cache(runner: ModelRunner) -> tuple[torch.Tensor, int]:
    """The KV cache of every layer (each ``Attention`` layer gets its slice) and its number of blocks."""
    config, device = runner.config, runner.device
    kv_cache_dtype = config.kv_cache_dtype
    reason = runner.backend.check_kv_cache_dtype(kv_cache_dtype, device)
    if reason is not None:
        from nanovllm_core.plugins import get_registry

        able = [
            r.name
            for r in get_registry().registrations["attention"].values()
            if r.obj.check_kv_cache_dtype(kv_cache_dtype, device) is None
            and r.obj.check_available(device, runner.dtype, runner.head_dim) is None
        ]
        raise ConfigError(
            f"attention backend {config.plugins.attention!r} ({type(runner.backend).__name__}) cannot keep "
            f"the KV cache in kv_cache_dtype={kv_cache_dtype!r}: {reason}; backends that can here: "
            f"{', '.join(sorted(able)) or 'none'} (set plugins.attention), or use kv_cache_dtype='auto'"
        )
    num_blocks = config.num_kvcache_blocks
    if not num_blocks and device.type == "cuda":  # what gpu_memory_utilization leaves after the activation peak
        _profile_run(runner)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        peak = torch.cuda.memory_stats(device)["allocated_bytes.all.peak"]
        current = torch.cuda.memory_stats(device)["allocated_bytes.all.current"]
        budget = total * config.gpu_memory_utilization - used - peak + current
        if budget <= 0:
            raise ConfigError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no memory for the KV "
                f"cache ({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB); raise it or use a smaller model"
            )
        num_blocks = int(budget // kv_block_bytes(runner))
    elif not num_blocks:
        num_blocks = int(config.cpu_kvcache_gib * 2**30 // kv_block_bytes(runner))
    if dist.is_initialized():  # every rank must hold the same number of blocks
        count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        all_reduce(count, op=dist.ReduceOp.MIN)  # a rank that failed to start is named, not a raw gloo error
        num_blocks = int(count.item())
    if num_blocks < 1:
        raise ConfigError("the KV cache would hold no block; set num_kvcache_blocks or give it more memory")
    shape, dtype = runner.backend.kv_cache_spec(
        kv_cache_dtype, num_blocks, runner.block_size, runner.num_kv_heads_local, runner.head_dim, runner.dtype
    )
    # zeros, not empty: a kernel may read a whole last block, and NaN garbage times a zero weight is NaN
    kv_cache = torch.zeros((len(runner.attention_layers), *shape), dtype=dtype, device=device)
    for i, layer in enumerate(runner.attention_layers):
        layer.kv_cache = kv_cache[i]
    logger.info(
        "KV cache: %d blocks of %d tokens, kv_cache_dtype=%s (%.2f GiB)",
        num_blocks,
        runner.block_size,
        kv_cache_dtype,
        kv_cache.numel() * kv_cache.element_size() / 2**30,
    )
    return kv_cache, num_blocks


def _profile_run(runner: ModelRunner) -> None:
    """One forward over ``max_num_batched_tokens`` tokens into a scratch cache, then logprobs over one slice
    of them (the most a step's logprobs hold at once), to measure the peak."""
    n = min(runner.config.max_num_batched_tokens, (runner.max_model_len - 1) * runner.config.max_num_seqs)
    num_seqs = max(1, min(runner.config.max_num_seqs, -(-n // (runner.max_model_len - 1))))
    lens = [n // num_seqs] * num_seqs
    lens[-1] += n - sum(lens)
    bs = runner.block_size
    blocks_per_seq = [-(-length // bs) for length in lens]
    scratch = torch.zeros(
        runner.backend.kv_cache_shape(sum(blocks_per_seq), bs, runner.num_kv_heads_local, runner.head_dim),
        dtype=runner.dtype,
        device=runner.device,
    )
    for layer in runner.attention_layers:
        layer.kv_cache = scratch
    tables, first = [], 0
    for nb in blocks_per_seq:
        tables.append(list(range(first, first + nb)))
        first += nb
    dev = runner.device
    batch = AttentionBatch.from_spans(tables, [(0, length) for length in lens], bs, dev)
    torch.cuda.reset_peak_memory_stats(dev)
    input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(length, device=dev) for length in lens])
    with torch.inference_mode(), forward_context(runner.backend, runner.backend.build_metadata(batch)):
        hidden = runner.model(input_ids, positions)
        runner.model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1])
        rows = hidden[:LOGPROBS_SLICE]
        compute_logprobs(runner.model.compute_logits(rows), input_ids[: rows.size(0)], MAX_LOGPROBS)
    torch.cuda.synchronize(dev)
    del scratch, hidden
