"""The structured-output bitmask applied to logits: the torch path against a per-token reference, and the Triton
kernel (Triton's interpreter on CPU, compiled on CUDA) against the torch path."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.layers.token_bitmask import apply_token_bitmask, unpack_bitmask
from nanovllm_core.structured_output import bitmask_words


def random_case(rows: int, vocab: int, bitmask_vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(bitmask_vocab)), generator=gen, dtype=torch.int64)
    return logits, words.to(torch.int32)


def reference(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.tolist()
    for i, row in enumerate(indices):
        for t in range(logits.size(1)):
            w = t // 32
            if w >= len(words[i]) or not (words[i][w] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, bitmask_vocab", [(100, 100), (96, 96), (130, 100)])
def test_the_torch_path_masks_exactly_the_clear_bits(vocab: int, bitmask_vocab: int) -> None:
    logits, bitmask = random_case(3, vocab, bitmask_vocab, seed=vocab)
    expected = reference(logits, bitmask, [2, 0])
    apply_token_bitmask(logits, bitmask[:2], [2, 0])
    assert torch.equal(logits, expected)  # row 1 untouched, columns past the bitmask masked


def test_unpack_reads_bit_t_of_word_t_div_32() -> None:
    bitmask = torch.tensor([[1 - 2**31, 2]], dtype=torch.int32)  # bits 0 and 31; bit 1
    allowed = unpack_bitmask(bitmask, 64).nonzero()[:, 1].tolist()
    assert allowed == [0, 31, 33]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_kernel_matches_the_torch_path(device: str) -> None:
    kernels = pytest.importorskip("nanovllm_core.layers.token_bitmask_kernel")
    logits, bitmask = random_case(5, 2100, 2050, seed=1)
    indices = [4, 1, 3]
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask[:3], indices)
    on_device = logits.to(device)
    index = torch.tensor(indices, dtype=torch.int32, device=device)
    kernels.apply_token_bitmask(on_device, bitmask[:3].to(device), index)
    assert torch.equal(on_device.cpu(), expected)
