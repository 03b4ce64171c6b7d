"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from types import ModuleType

import torch

from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.layers.fused import fused_enabled, temperature_race
from nanovllm_core.sequence import Sequence


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperatures: torch.Tensor  # float32 [n]; 0 rows are greedy
    top_k: torch.Tensor | None  # int64 [n]; vocab size where disabled
    top_p: torch.Tensor | None  # float32 [n]
    min_p: torch.Tensor | None  # float32 [n]
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool = True

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        params = [s.sampling_params for s in seqs]
        temperatures = [p.temperature for p in params]
        num_greedy = temperatures.count(0)  # 0.0 == 0, so this counts both
        all_greedy = num_greedy == len(params)
        top_k = top_p = min_p = None
        filtered = not all_greedy and any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        if filtered:
            if any(p.top_k > 0 for p in params):
                top_k = host_tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64, device)
            if any(p.top_p < 1 for p in params):
                top_p = host_tensor([p.top_p for p in params], torch.float32, device)
            if any(p.min_p > 0 for p in params):
                min_p = host_tensor([p.min_p for p in params], torch.float32, device)
        return cls(
            host_tensor(temperatures, torch.float32, device),
            top_k,
            top_p,
            min_p,
            [s.generator for s in seqs],
            all_greedy,
            num_greedy > 0,
        )


class Sampler:
    """Picks one token per row of ``logits``.

    Sampling uses the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from
    ``p`` exactly and lets a seeded request draw its noise from its own generator, so its tokens do not
    depend on what else is in the batch.

    On CUDA, batches with temperature only (no top-k/top-p/min-p, no seeded request) take one Triton kernel
    that makes its noise in-kernel from a Philox seed (``sampling_kernel.sample_temperature``). The seeds come
    from a host-side stream started from ``seed`` (default: the generator's initial seed, else 0): reading the
    device generator's state every step would synchronise with the GPU.
    """

    def __init__(self, generator: torch.Generator | None = None, *, seed: int | None = None) -> None:
        self.generator = generator
        if seed is None:
            seed = generator.initial_seed() if generator is not None else 0
        self._kernel_seeds = random.Random(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        if self._use_kernel(logits, batch):
            return _sampling_kernel().sample_temperature(logits, batch.temperatures, self._kernel_seeds.getrandbits(31))
        temps = batch.temperatures
        is_greedy = temps == 0
        safe_temps = torch.where(is_greedy, torch.ones_like(temps), temps)
        if batch.top_k is None and batch.top_p is None and batch.min_p is None:
            noise = self._exponential_noise(logits, batch.generators)
            sampled = temperature_race(logits, safe_temps, noise)
        else:
            logits32 = logits.float() / safe_temps.unsqueeze(1)
            if batch.top_k is not None or batch.top_p is not None:
                logits32 = self._top_k_top_p(logits32, batch.top_k, batch.top_p)
            probs = torch.softmax(logits32, dim=-1)
            if batch.min_p is not None:
                threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
                probs = probs.masked_fill(probs < threshold, 0.0)
            sampled = (probs / self._exponential_noise(probs, batch.generators)).argmax(dim=-1)
        if batch.any_greedy:
            return torch.where(is_greedy, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def _use_kernel(logits: torch.Tensor, batch: SamplingBatch) -> bool:
        return logits.is_cuda and fused_enabled() and kernel_eligible(batch) and _sampling_kernel() is not None

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if top_k is not None:
            ranks = torch.arange(logits.size(-1), device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        if top_p is not None:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)
        if self.generator is not None and self.generator.device == probs.device:
            noise.exponential_(generator=self.generator)
        else:
            noise.exponential_()
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row] = torch.empty(probs.size(-1)).exponential_(generator=gen).to(probs.device)
        return noise


def kernel_eligible(batch: SamplingBatch) -> bool:
    """Whether the in-kernel-noise sampler can draw this batch: temperature only, no per-request generator."""
    no_filters = batch.top_k is None and batch.top_p is None and batch.min_p is None
    return no_filters and all(gen is None for gen in batch.generators)


@functools.cache
def _sampling_kernel() -> ModuleType | None:
    """The Triton sampling module, or None without triton (core does not depend on it)."""
    try:
        from nanovllm_core.layers import sampling_kernel
    except ImportError:
        return None
    return sampling_kernel
