"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from nanovllm_core.layers.fused import temperature_race
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
        temps = torch.frombuffer(array("f", temperatures), dtype=torch.float32)
        if device.type == "cuda":
            temps = temps.pin_memory()
        top_k = top_p = min_p = None
        filtered = not all_greedy and any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        if filtered:
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]).to(device)
            if any(p.top_p < 1 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(device)
        return cls(
            temps.to(device, non_blocking=True),
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
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
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
