"""The in-kernel-noise temperature sampler (``nanovllm_core.layers.sampling_kernel``).

On CPU the kernel runs in Triton's interpreter, which computes the same float32 arithmetic as the NumPy
reference below, so tokens must match it exactly; the reference's own distribution is checked with many draws
(the interpreter spends ~30 ms per program, too slow for thousands of rows). On CUDA the compiled kernel is
checked for argmax rows, against the reference, and statistically.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from nanovllm_core import SamplingParams  # noqa: E402
from nanovllm_core.layers.sampler import Sampler, SamplingBatch, kernel_eligible  # noqa: E402
from nanovllm_core.layers.sampling_kernel import sample_temperature  # noqa: E402
from nanovllm_core.sequence import Sequence  # noqa: E402

_MASK32 = np.uint64(0xFFFFFFFF)


def philox(seed: int, c0: np.ndarray, c1: int | np.ndarray) -> list[np.ndarray]:
    """Philox4x32-10 of counters ``(c0, c1, 0, 0)`` with key ``(seed, 0)``, as ``tl.randint4x`` computes it."""
    c0, c1 = np.broadcast_arrays(np.asarray(c0, dtype=np.uint64), np.asarray(c1, dtype=np.uint64))
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed), np.uint64(0)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        prod_a, prod_b = round_a * c0, round_b * c2
        c0, c2 = (prod_b >> np.uint64(32)) ^ c1 ^ k0, (prod_a >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = prod_b & _MASK32, prod_a & _MASK32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK32, (k1 + np.uint64(0xBB67AE85)) & _MASK32
    return [c.astype(np.uint32) for c in (c0, c1, c2, c3)]


def reference_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, block: int) -> torch.Tensor:
    """The kernel's arithmetic in NumPy float32: logit ``(4t + k) * Q + i`` takes Philox output ``k`` of counter
    ``(t * Q + i, row)``, score ``logit * log2(e) / T - log2(-log2 U)``; argmax where ``T == 0``."""
    x = logits.float().numpy()
    rows, vocab = x.shape
    quarter = block // 4
    j = np.arange(vocab)
    tile, k, lane = j // block, (j // quarter) % 4, j % quarter
    out = []
    for row in range(rows):
        temp = np.float32(temperatures[row].item())
        if temp == 0:
            out.append(int(np.argmax(x[row])))
            continue
        bits = np.stack(philox(seed, (tile * quarter + lane).astype(np.uint32), row))[k, np.arange(vocab)]
        u = ((bits >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
        noise = np.log2(np.maximum(-np.log2(u), np.float32(8e-8)))
        score = x[row] * (np.float32(1.4426950408889634) / temp) - noise
        out.append(int(np.argmax(score)))
    return torch.tensor(out)


def five_sigma_check(tokens: torch.Tensor, logits: torch.Tensor, temperature: float) -> None:
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    freqs = torch.bincount(tokens.cpu(), minlength=probs.numel()).double() / tokens.numel()
    stderr = (probs * (1 - probs) / tokens.numel()).sqrt()
    assert ((freqs - probs).abs() < 5 * stderr + 1e-12).all(), (freqs, probs)


# ----------------------------------------------------------------------------------------------------
# Interpreter (CPU)
# ----------------------------------------------------------------------------------------------------


def test_reference_is_triton_philox():
    # tl.randint4x(seed=12345, offset=(7 << 32) + c) for c = 0, 1 (Triton's interpreter with TRITON_INTERPRET=1)
    expected = [[3349521908, 2777630535], [3203357690, 214264228], [2570583922, 3216316146], [1328855023, 284060897]]
    assert [o.tolist() for o in philox(12345, np.arange(2, dtype=np.uint32), 7)] == expected


def test_greedy_rows_are_argmax():
    logits = torch.randn(3, 5003, generator=torch.Generator().manual_seed(0))
    out = sample_temperature(logits, torch.zeros(3), seed=1, block=256)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize(("vocab", "block", "splits"), [(1000, 64, 1), (5003, 512, 3)])
def test_mixed_rows_match_reference(vocab, block, splits):
    logits = 3 * torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 2.5])
    out = sample_temperature(logits.bfloat16(), temps, seed=42, block=block, num_splits=splits)
    assert torch.equal(out, reference_tokens(logits.bfloat16(), temps, 42, block))
    assert torch.equal(out[[0, 2]], logits.bfloat16().argmax(dim=-1)[[0, 2]])


def test_split_does_not_change_tokens():
    logits = torch.randn(2, 700, generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([1.0, 0.5])
    one = sample_temperature(logits, temps, seed=9, block=64, num_splits=1)
    assert torch.equal(one, sample_temperature(logits, temps, seed=9, block=64, num_splits=4))


def test_neg_inf_logits_never_picked():
    vocab = 300  # 5 tiles of 64 in 2 splits, the last tile partial
    allowed = torch.tensor([5, 70, 299])
    logits = torch.full((8, vocab), float("-inf"))
    logits[:, allowed] = torch.tensor([0.0, -1.0, 0.5])
    logits[-1] = float("-inf")  # whole row masked: any valid index
    temps = torch.full((8,), 5.0)
    temps[0] = 0.0
    out = sample_temperature(logits, temps, seed=3, block=64, num_splits=2)
    assert torch.isin(out[:-1], allowed).all()
    assert out[0] == 299
    assert 0 <= out[-1] < vocab


def test_seed_determinism():
    logits = torch.zeros(16, 64)
    temps = torch.ones(16)
    first = sample_temperature(logits, temps, seed=5, block=64)
    assert torch.equal(first, sample_temperature(logits, temps, seed=5, block=64))
    assert not torch.equal(first, sample_temperature(logits, temps, seed=6, block=64))
    assert len(set(first.tolist())) > 8  # uniform over 64: rows get different noise


SMALL_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5])


def test_reference_follows_softmax():
    # the NumPy reference (block 8) on 40k rows at once
    rows, temperature, seed = 40_000, 0.7, 11
    j = np.arange(8)  # one tile of 8: logit j takes output j // 2 of counter (j % 2, row)
    outputs = np.stack(philox(seed, (j % 2)[None, :], np.arange(rows)[:, None]))  # [4, rows, 8]
    bits = np.take_along_axis(outputs, (j // 2)[None, None, :], axis=0)[0]
    u = ((bits >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    score = SMALL_LOGITS.numpy() * np.float32(1.4426950408889634 / temperature) - np.log2(-np.log2(u))
    five_sigma_check(torch.from_numpy(score.argmax(axis=1)), SMALL_LOGITS, temperature)


def test_kernel_distribution_in_one_launch():
    # matching the reference exactly is the real check (the reference's distribution is tested above); 128
    # interpreted rows only allow a loose 5-sigma bound
    rows, temperature = 128, 0.7
    logits = SMALL_LOGITS.expand(rows, -1)
    out = sample_temperature(logits, torch.full((rows,), temperature), seed=11, block=8)
    assert torch.equal(out, reference_tokens(logits, torch.full((rows,), temperature), 11, 8))
    five_sigma_check(out, SMALL_LOGITS, temperature)


# ----------------------------------------------------------------------------------------------------
# Sampler dispatch
# ----------------------------------------------------------------------------------------------------


def batch_for(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    return SamplingBatch.from_seqs([Sequence([1], p) for p in params], vocab, torch.device("cpu"))


def test_kernel_eligibility():
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=0)]
    assert kernel_eligible(batch_for(plain, 16))
    assert not kernel_eligible(batch_for([SamplingParams(temperature=0.8, top_k=3)], 16))
    assert not kernel_eligible(batch_for([SamplingParams(temperature=0.8, min_p=0.1)], 16))
    assert not kernel_eligible(batch_for([SamplingParams(temperature=0.8, seed=1)], 16))
    # CPU logits keep the torch path
    assert not Sampler._use_kernel(torch.zeros(2, 16), batch_for(plain, 16))


def test_sampler_feeds_kernel_a_seed_stream(monkeypatch):
    monkeypatch.setattr(Sampler, "_use_kernel", staticmethod(lambda logits, batch: kernel_eligible(batch)))
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7, 1.3)]
    batch = batch_for(params, 64)
    seeds = random.Random(7)
    sampler = Sampler(torch.Generator().manual_seed(123), seed=7)
    for _ in range(2):
        expected = sample_temperature(logits, batch.temperatures, seeds.getrandbits(31))
        assert torch.equal(sampler(logits, batch), expected)
    # without a seed the stream starts from the generator's seed
    default = Sampler(torch.Generator().manual_seed(7))
    assert torch.equal(
        default(logits, batch), sample_temperature(logits, batch.temperatures, random.Random(7).getrandbits(31))
    )


# ----------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernel():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 256, 151936
    logits = (3 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16()
    peaks = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    logits[torch.arange(rows, device="cuda"), peaks] = 30.0  # a unique maximum per row
    temps = torch.where(torch.arange(rows, device="cuda") % 2 == 0, 0.0, 1.0)
    for splits in (None, 1):  # default split (several per row at 256 rows on an H200) and one program per row
        out = sample_temperature(logits, temps, seed=123, num_splits=splits)
        assert out.dtype == torch.int64 and out.device == logits.device
        assert torch.equal(out[0::2], peaks[0::2])
        assert torch.isfinite(logits.gather(1, out[:, None]).float()).all()

    # exactly the interpreter's tokens (barring a near-tie flipped by fast log2) on a few full-vocab rows
    small = logits[:8].float()
    temps8 = torch.tensor([0.0, 1.0, 0.7, 2.0, 1.0, 1.0, 0.3, 1.0], device="cuda")
    out = sample_temperature(small, temps8, seed=77)
    assert torch.equal(out.cpu(), reference_tokens(small.cpu(), temps8.cpu(), 77, 4096))

    many = 200_000
    out = sample_temperature(SMALL_LOGITS.cuda().expand(many, -1), torch.full((many,), 0.7, device="cuda"), seed=5)
    five_sigma_check(out, SMALL_LOGITS, 0.7)
    # a full vocabulary with a few likely tokens and a long tail, bf16
    wide = torch.full((vocab,), -4.0)
    wide[[3, 50_000, 151_935]] = torch.tensor([6.0, 5.0, 5.5])
    out = sample_temperature(wide.bfloat16().cuda().expand(4096, -1), torch.ones(4096, device="cuda"), seed=6)
    probs = torch.softmax(wide.double(), dim=-1)
    buckets = torch.tensor([3, 50_000, 151_935])
    freqs = (out.cpu()[:, None] == buckets).double().mean(dim=0)
    stderr = (probs[buckets] * (1 - probs[buckets]) / 4096).sqrt()
    assert ((freqs - probs[buckets]).abs() < 5 * stderr).all(), (freqs, probs[buckets])


def test_warmup_launches_each_split_bucket_once():
    """``warmup`` runs one launch per power-of-two bucket of split counts (what the merge kernel is compiled for):
    10 tiles of 4 logits give split counts 1, 2, 3, 4, 5, 10: buckets 1, 2, 4, 8, 16."""
    from nanovllm_core.layers import sampling_kernel

    assert sampling_kernel.warmup(torch.zeros(3, 40), block=4) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_warmup_no_row_count_compiles_a_kernel(monkeypatch: pytest.MonkeyPatch):
    """Every row count a step can have (1 to 600) samples with kernels the warm-up compiled (the first
    ``generate`` on an H200 compiled four merge variants before this warm-up existed)."""
    from triton.runtime.jit import JITFunction

    from nanovllm_core.layers import sampling_kernel

    logits = torch.randn(600, 151936, device="cuda", dtype=torch.bfloat16)
    sampling_kernel.warmup(logits)
    compiled = []
    original = JITFunction._do_compile

    def record(self, *args, **kwargs):
        compiled.append(self.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", record)
    temperatures = torch.ones(600, device="cuda")
    for rows in range(1, 601):
        sample_temperature(logits[:rows], temperatures[:rows], rows)
    torch.cuda.synchronize()
    assert compiled == []
