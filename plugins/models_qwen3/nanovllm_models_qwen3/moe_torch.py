"""Mixture-of-experts in plain PyTorch: runs on any device and is the reference for the fused Triton path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` for every token ``t``.

    Shapes: ``hidden_states`` [T, H]; ``w13`` [E, 2N, H] (each expert's gate rows, then its up rows);
    ``w2`` [E, H, N]; ``topk_weights`` [T, K] (any float dtype; cast to ``hidden_states.dtype``, as
    transformers does); ``topk_ids`` [T, K] int. An expert is ``down(silu(gate(x)) * up(x))``.

    Loops over the experts that received tokens, in ascending order, and accumulates with ``index_add_``:
    the same order of operations as ``transformers``' eager ``Qwen3MoeExperts``, so float32 results agree
    with it bit for bit on the CPU. One host sync (the per-expert token counts).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden_states)
    if num_tokens == 0:
        return out
    weights = topk_weights.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.size(0)).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden_states[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        y = y * weights.reshape(-1)[pairs].unsqueeze(-1)
        out.index_add_(0, tokens, y)
    return out
