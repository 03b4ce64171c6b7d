"""The lower bound of a workload's time on one configuration, and where a run's decode steps spend theirs.

Pure arithmetic over a model's shape, its configuration and two device rates (``device.measure_device``), so that
a CPU test can check it. The bound follows the configuration:

- KV bytes per token from ``kv_cache_dtype``: the model's dtype for ``auto``; for ``fp8`` one byte an element plus
  the scale each (token, KV head) carries (a float32 in the ``triton`` and ``torch`` backends' layout;
  ``nanovllm bench`` passes the running backend's own bytes);
- weight bytes from the weight dtype, or, with a quantization method, its bits per weight for the decoder's linear
  layers (the LM head stays in the weight dtype; scales are not counted, which keeps it a bound);
- the tensor-parallel size: each GPU holds its share of the heads, the MLP and the LM head (KV heads are
  replicated when there are fewer than GPUs) and moves it at one GPU's rates, all GPUs at once. The all-reduces
  between them are not counted, which keeps it a lower bound.

Two forms: the additive one (every byte over the copy bandwidth plus every matmul FLOP over the GEMM rate) and the
per-step one, the tighter, which ``nanovllm bench`` reports first: each decode step takes the longer of its bytes
(weights once, the KV it reads and writes) and its matmul FLOPs (a step whose GEMMs are compute-bound is not also
memory-bound), plus the prompts as one prefill (their FLOPs, or their KV writes if longer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanovllm_core.errors import ConfigError

FP8_SCALE_BYTES = 4  # one float32 scale per (token, KV head), as the fp8 caches of the bundled backends store it
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class ModelCost:
    """What one GPU of a configuration holds and moves: its share of the matmul weights and of the KV cache."""

    num_layers: int
    num_heads: int  # query heads on one GPU
    num_kv_heads: int  # KV heads on one GPU
    head_dim: int
    matmul_params: int  # weights of every matmul on one GPU, the LM head included
    weight_bytes: int
    kv_bytes_per_token_per_layer: int  # K and V of one token in one layer, scales included
    kv_cache_dtype: str
    weight_dtype: str
    tensor_parallel_size: int
    quantization: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.num_layers

    def describe(self) -> str:
        """The bound's configuration in one phrase, e.g. ``KV fp8 e4m3 + fp32 scales (...), weights bf16, TP 1``."""
        per_layer = f"{self.kv_bytes_per_token_per_layer:,} bytes/token/layer"
        if self.kv_cache_dtype in FP8_KV_DTYPES:
            scale = self.kv_bytes_per_token_per_layer // (2 * self.num_kv_heads) - self.head_dim
            scales = "fp32 scales" if scale == FP8_SCALE_BYTES else f"{scale}-byte scales"
            kv = f"KV fp8 e4m3 + {scales} ({per_layer})"
        else:
            kv = f"KV {self.weight_dtype} ({per_layer})"
        weights = self.weight_dtype
        if self.quantization is not None:
            weights = f"{self.quantization} (LM head {self.weight_dtype})"
        return f"{kv}, weights {weights} ({self.weight_bytes / 2**30:.2f} GiB a GPU), TP {self.tensor_parallel_size}"


def _per_gpu(count: int, tp: int, what: str) -> int:
    if count % tp:
        raise ConfigError(f"{what} ({count}) is not divisible by tensor_parallel_size ({tp})")
    return count // tp


def model_cost(
    hf_config: Any,
    weight_dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    kv_bytes_per_token_per_layer: int | None = None,
    quantization: str | None = None,
    quantized_weight_bits: int | None = None,
) -> ModelCost:
    """One GPU's share of ``hf_config``'s weights and KV cache under this configuration.

    ``quantization``, ``quantized_weight_bits``: the quantization method's name and its bits per weight of the
    decoder layers' linear layers (the LM head keeps ``weight_dtype``).

    ``kv_bytes_per_token_per_layer``: the running cache's bytes when known (the attention backend's layout);
    otherwise computed from ``kv_cache_dtype`` (``auto``: ``weight_dtype``'s bytes; ``fp8``/``fp8_e4m3``: one
    byte an element plus a float32 scale per token and KV head)."""
    if weight_dtype not in DTYPE_NAMES:
        raise ConfigError(f"weight dtype {weight_dtype}: the bound knows {', '.join(map(str, DTYPE_NAMES))}")
    if kv_cache_dtype not in ("auto", *FP8_KV_DTYPES):
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r}: the bound knows 'auto', 'fp8' and 'fp8_e4m3'")
    tp = tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size {tp}: at least 1")
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    heads_local = _per_gpu(heads, tp, "num_attention_heads")
    kv_local = _per_gpu(kv_heads, tp, "num_key_value_heads") if kv_heads >= tp else 1
    inter_local = _per_gpu(hf_config.intermediate_size, tp, "intermediate_size")
    vocab_local = -(-hf_config.vocab_size // tp)  # the LM head's vocabulary shard, padded as the engine pads it
    per_layer = (
        hidden * (heads_local + 2 * kv_local) * head_dim  # q, k and v
        + heads_local * head_dim * hidden  # o
        + 3 * hidden * inter_local  # gate, up and down
    )
    lm_head_params = vocab_local * hidden
    matmul_params = layers * per_layer + lm_head_params  # the LM head is a matmul too
    element_bytes = weight_dtype.itemsize
    weight_bytes = matmul_params * element_bytes
    if quantization is not None:
        bits = quantized_weight_bits or 8 * element_bytes
        weight_bytes = layers * per_layer * bits // 8 + lm_head_params * element_bytes
    if kv_bytes_per_token_per_layer is None:
        if kv_cache_dtype in FP8_KV_DTYPES:
            kv_bytes_per_token_per_layer = 2 * kv_local * (head_dim + FP8_SCALE_BYTES)
        else:
            kv_bytes_per_token_per_layer = 2 * kv_local * head_dim * element_bytes
    return ModelCost(
        num_layers=layers,
        num_heads=heads_local,
        num_kv_heads=kv_local,
        head_dim=head_dim,
        matmul_params=matmul_params,
        weight_bytes=weight_bytes,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer,
        kv_cache_dtype=kv_cache_dtype,
        weight_dtype=DTYPE_NAMES[weight_dtype],
        tensor_parallel_size=tp,
        quantization=quantization,
    )


def bound_seconds(
    cost: ModelCost, prompts: list[list[int]], max_tokens: list[int], rates: dict[str, float]
) -> dict[str, float]:
    """Both bounds of generating ``max_tokens[i]`` tokens after ``prompts[i]``, all at once, at ``rates``
    (``copy_bytes_per_s``: bytes read plus written a second; ``gemm_flop_per_s``) of one GPU."""
    kv_per_token, weight_bytes, matmul_params = cost.kv_bytes_per_token, cost.weight_bytes, cost.matmul_params
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(max_tokens)
    decode_steps = max(max_tokens) - 1
    kv_read = sum(kv_per_token * (len(p) * (m - 1) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
    kv_written = kv_per_token * (prompt_tokens + output_tokens)
    bytes_moved = kv_read + kv_written + weight_bytes * decode_steps
    flops = 2 * matmul_params * (prompt_tokens + output_tokens)
    # causal attention of the prompts (QK^T and PV)
    flops += sum(2 * 2 * cost.num_layers * cost.num_heads * cost.head_dim * len(p) * len(p) / 2 for p in prompts)
    bandwidth, gemm_rate = rates["copy_bytes_per_s"], rates["gemm_flop_per_s"]
    memory_s = bytes_moved / bandwidth
    compute_s = flops / gemm_rate
    prompt_flops = flops - 2 * matmul_params * output_tokens
    per_step_s = max(prompt_flops / gemm_rate, kv_per_token * prompt_tokens / bandwidth)
    by_length = sorted(zip(max_tokens, (len(p) for p in prompts)))
    active, context = len(by_length), prompt_tokens  # decoding sequences, their prompt tokens
    done = 0
    for step in range(1, decode_steps + 1):
        while done < len(by_length) and by_length[done][0] - 1 < step:  # produced all its tokens
            active -= 1
            context -= by_length[done][1]
            done += 1
        read = context + step * active  # each sequence reads its prompt and the tokens generated so far
        step_bytes = weight_bytes + kv_per_token * (read + active)
        step_flops = 2 * matmul_params * active
        per_step_s += max(step_bytes / bandwidth, step_flops / gemm_rate)
    return {
        "bound_s": memory_s + compute_s,
        "per_step_bound_s": per_step_s,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bytes_moved": bytes_moved,
        "flops": flops,
        "kv_bytes_per_token": kv_per_token,
        "weight_bytes": weight_bytes,
    }


def fit_decode_steps(records: list[tuple[int, int, int, float]], kv_bytes_per_token: int) -> dict[str, Any]:
    """Where a run's decode steps spend their GPU time, from each step's (sequences, query tokens, KV tokens
    attended, GPU ms) as the model runner records them.

    A least-squares fit of ``ms = fixed + per_seq * sequences + per_kv_token * kv_tokens`` over the pure decode
    steps (one query token a sequence) splits their time into a part every step pays whatever its batch (weights
    read, launches, the per-kernel floors), a part that grows with the batch (GEMM rows, sampling) and a part that
    grows with the context read (decode attention: ``kv_bytes_per_token / per_kv_token`` is its KV read rate).
    Steps with prompt tokens are summed apart."""
    decode = [r for r in records if r[0] == r[1]]
    result: dict[str, Any] = {"decode_steps": len(decode), "prompt_steps": len(records) - len(decode)}
    result["prompt_steps_gpu_s"] = sum(r[3] for r in records if r[0] != r[1]) / 1e3
    if len(decode) < 4:
        return result
    x = torch.tensor([[1.0, r[0], r[2]] for r in decode], dtype=torch.float64)
    y = torch.tensor([r[3] for r in decode], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    residual = float(((y - x @ coef) ** 2).sum())
    spread = float(((y - y.mean()) ** 2).sum())
    fixed_ms, per_seq_ms, per_kv_ms = (float(c) for c in coef)
    seqs, kv = float(x[:, 1].sum()), float(x[:, 2].sum())
    result.update(
        decode_steps_gpu_s=float(y.sum()) / 1e3,
        fixed_ms_per_step=fixed_ms,
        per_seq_us=1e3 * per_seq_ms,
        per_kv_token_ns=1e6 * per_kv_ms,
        kv_read_bytes_per_s=kv_bytes_per_token / (per_kv_ms / 1e3) if per_kv_ms > 0 else None,
        fixed_s=fixed_ms * len(decode) / 1e3,
        per_seq_s=per_seq_ms * seqs / 1e3,
        per_kv_s=per_kv_ms * kv / 1e3,
        r2=1 - residual / spread if spread else None,
    )
    return result
