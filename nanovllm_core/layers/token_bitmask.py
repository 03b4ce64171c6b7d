"""Structured output's last step before sampling: tokens a grammar forbids get a logit of ``-inf``.

The bitmask is xgrammar's and vLLM's layout (:mod:`nanovllm_core.structured_output`): int32
``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed. On CUDA one
Triton kernel masks every constrained row of the step (``token_bitmask_kernel``); elsewhere torch does.
"""

from __future__ import annotations

import torch

from nanovllm_core.layers.triton_jit import kernel_module


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool ``[rows, vocab]``: whether each token is allowed (columns past the bitmask's words are not)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.size(1) >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.size(0), vocab - bits.size(1))], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """In place: row ``indices[i]`` of ``logits`` keeps only the tokens that row ``i`` of ``bitmask`` (on the host
    or the logits' device) allows; the other rows are untouched."""
    if not indices:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    kernels = kernel_module("token_bitmask_kernel") if logits.is_cuda else None
    if kernels is not None:
        index = torch.tensor(indices, dtype=torch.int32).to(logits.device, non_blocking=True)
        kernels.apply_token_bitmask(logits, bitmask, index)
        return
    rows = torch.tensor(indices, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask, logits.size(-1))
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
