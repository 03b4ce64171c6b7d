"""A structured-output bitmask applied to the logits in one Triton kernel (imports ``triton``: import it lazily).

Every constrained row of the step in one launch: program (row, column block) reads the row's packed words and
writes ``-inf`` over the tokens whose bit is clear; allowed logits are not touched (no load of the logits).
The torch path (:func:`nanovllm_core.layers.token_bitmask.apply_token_bitmask`) is the reference; on CPU tensors
the same kernel runs in Triton's interpreter for the tests.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm_core.layers.triton_jit import wrap_kernel

BLOCK = 1024  # columns a program: 32 words of the bitmask


def _token_bitmask_kernel(LOGITS, BITMASK, INDICES, vocab, num_words, stride_logits, stride_bitmask,
                          BLOCK: tl.constexpr):  # fmt: skip
    """Program (i, column block): ``LOGITS[INDICES[i], c] = -inf`` where bit ``c % 32`` of
    ``BITMASK[i, c // 32]`` is clear (columns past the bitmask's words count as clear)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    words = tl.load(BITMASK + i.to(tl.int64) * stride_bitmask + cols // 32,
                    mask=in_vocab & (cols // 32 < num_words), other=0)  # fmt: skip
    allowed = (words >> (cols % 32)) & 1
    row = tl.load(INDICES + i).to(tl.int64)
    tl.store(LOGITS + row * stride_logits + cols, float("-inf"), mask=in_vocab & (allowed == 0))


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> object:
    return wrap_kernel(_token_bitmask_kernel, interpret)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """In place: row ``indices[i]`` of ``logits`` keeps only the tokens row ``i`` of ``bitmask`` allows.

    ``bitmask`` (int32 ``[len(indices), words]``) and ``indices`` (int32/int64) on the logits' device; CUDA tensors
    run the compiled kernel without synchronising with the host, others Triton's interpreter (tests only)."""
    if not len(indices):
        return
    if logits.stride(-1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
    vocab = logits.size(-1)
    _kernel(logits.device.type != "cuda")[(len(indices), triton.cdiv(vocab, BLOCK))](
        logits, bitmask, indices, vocab, bitmask.size(1), logits.stride(0), bitmask.stride(0), BLOCK=BLOCK,
        num_warps=4,
    )  # fmt: skip
