"""Token sampling: logit adjustments (min_tokens, logit_bias, allowed_token_ids), penalties, greedy, temperature,
top-k, top-p, min-p, with per-request seeds; logprobs."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.layers.fused import fused_enabled, temperature_race
from nanovllm_core.layers.triton_jit import kernel_module
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence


@dataclass
class Penalties:
    """vLLM's presence, frequency and repetition penalties for the rows of a batch that use them.

    ``repetition`` divides the positive logits and multiplies the others of every token in the prompt or the
    output; then ``frequency`` times a token's count in the output and ``presence`` (once) for a token in the
    output are subtracted. The counts are rows ``table_rows`` of :class:`SamplingState`'s persistent tables.
    """

    rows: torch.Tensor  # int64 [m]: which rows of the batch
    presence: torch.Tensor  # float32 [m]
    frequency: torch.Tensor  # float32 [m]
    repetition: torch.Tensor  # float32 [m]
    table_rows: torch.Tensor  # int64 [m]: their rows of counts and prompt_seen
    counts: torch.Tensor  # float32 [rows, vocab]: occurrences of each token in the output
    prompt_seen: torch.Tensor  # bool [rows, vocab]: in the prompt (rows with a repetition penalty only)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalised logits as a new float32 tensor (``logits`` is left as it is)."""
        logits = logits.float()
        penalised = logits[self.rows]
        output_counts = self.counts[self.table_rows]
        seen = self.prompt_seen[self.table_rows] | (output_counts > 0)
        repetition = self.repetition.unsqueeze(1)
        repeated = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
        penalised = torch.where(seen, repeated, penalised)
        penalised -= self.frequency.unsqueeze(1) * output_counts
        penalised -= self.presence.unsqueeze(1) * (output_counts > 0)
        return logits.index_copy(0, self.rows, penalised)

    def record(self, tokens: torch.Tensor) -> None:
        """Count this step's sampled ``tokens`` (one per row of the batch) into the output counts, on the device."""
        sampled = tokens[self.rows]
        self.counts.index_put_((self.table_rows, sampled), torch.ones_like(sampled, dtype=torch.float32), True)


@dataclass
class LogitAdjustments:
    """What ``allowed_token_ids``, ``min_tokens``, ``bad_words`` and ``logit_bias`` do to the logits of the rows
    that use them, in that order (vLLM's): every token but the allowed ones masked; the EOS and stop tokens masked
    while a sequence has fewer than ``min_tokens`` tokens out; a bad word's last token masked where the output
    ends with the rest of it; the biases added. Masked logits are -inf."""

    rows: torch.Tensor  # int64 [m]: which rows of the batch
    allowed: torch.Tensor | None  # bool [m, vocab]: what a row may sample (everything for rows without a list)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (index into rows, token id) pairs masked this step
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (index into rows, token id, float32 bias)

    @classmethod
    def from_seqs(
        cls, seqs: list[Sequence], rows: list[int], vocab_size: int, device: torch.device
    ) -> LogitAdjustments:
        params = [seqs[row].sampling_params for row in rows]
        allowed = None
        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if restricted:
            allowed = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
            allowed[host_tensor(restricted, torch.int64, device)] = False
            lists = [(i, params[i].allowed_token_ids) for i in restricted]
            allowed_rows = host_tensor([i for i, ids in lists for _ in ids], torch.int64, device)
            allowed[allowed_rows, host_tensor([t for _, ids in lists for t in ids], torch.int64, device)] = True
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, (row, p) in enumerate(zip(rows, params)):
            if p.min_tokens and seqs[row].num_completion_tokens < p.min_tokens:
                banned_rows += [i] * len(p.all_stop_token_ids)
                banned_ids += p.all_stop_token_ids
            if p.bad_words_token_ids:  # the output's real tokens are on the host (needs_output_token_ids)
                output = seqs[row].completion_token_ids
                for word in p.bad_words_token_ids:
                    before = len(word) - 1
                    if before == 0 or (len(output) >= before and output[len(output) - before :] == word[:-1]):
                        banned_rows.append(i)
                        banned_ids.append(word[-1])
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
        ints = functools.partial(host_tensor, dtype=torch.int64, device=device)
        banned = (ints(banned_rows), ints(banned_ids)) if banned_ids else None
        bias = (ints(bias_rows), ints(bias_ids), host_tensor(bias_values, torch.float32, device)) if bias_ids else None
        return cls(ints(rows), allowed, banned, bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits as a new float32 tensor (``logits`` is left as it is)."""
        logits = logits.float()
        adjusted = logits[self.rows]
        if self.allowed is not None:
            adjusted = adjusted.masked_fill(~self.allowed, float("-inf"))
        if self.banned is not None:
            adjusted[self.banned] = float("-inf")
        if self.bias is not None:
            index_rows, index_ids, values = self.bias
            adjusted.index_put_((index_rows, index_ids), values, accumulate=True)
        return logits.index_copy(0, self.rows, adjusted)


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
    penalties: Penalties | None = None
    num_logprobs: list[int | None] | None = None  # each row's ``logprobs``; None when no row asks
    adjustments: LogitAdjustments | None = None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        """The batch of ``seqs`` alone (a one-off :class:`SamplingState`)."""
        state = SamplingState(vocab_size, device)
        return state.batch(seqs, state.add(seqs))


def _param_row(p: SamplingParams, vocab_size: int) -> list[float]:
    """A request's row of :attr:`SamplingState.params`: temperature, top-k (the vocabulary size where off), top-p,
    min-p, presence, frequency and repetition penalties (float32 holds every top-k exactly)."""
    top_k = p.top_k if p.top_k > 0 else vocab_size
    return [p.temperature, top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty]


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:
    """``table`` with at least ``rows`` rows (doubling; new rows zero)."""
    if table.size(0) >= rows:
        return table
    grown = table.new_zeros((max(rows, 2 * table.size(0)), *table.shape[1:]))
    grown[: table.size(0)] = table
    return grown


class _Rows:
    """Row numbers of a table handed out and given back; ``high``: rows the table needs."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.high = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.high += 1
        return self.high - 1


class SamplingState:
    """Per-request sampling state in persistent tensors, one row (slot) per request (vLLM's ``InputBatch``).

    A request's parameters are written once, when it joins (:meth:`add`); the output-token counts of a request
    with penalties start from its tokens then and grow on the device by each step's sampled tokens
    (:meth:`Penalties.record`); :meth:`remove` frees its slot. A step gathers its rows (:meth:`batch`) instead of
    rebuilding tensors from the sequences; the count tables hold rows for requests with penalties only.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.params = torch.zeros((0, 7), dtype=torch.float32, device=device)  # a row per slot (_param_row)
        self.slots, self.penalty_rows = _Rows(), _Rows()
        self.penalty_row_of: dict[int, int] = {}  # slot -> its row of counts and prompt_seen
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        # the last step's slots, batch and rows with logit adjustments
        self._last: tuple[list[int], SamplingBatch, list[int]] | None = None

    def add(self, seqs: list[Sequence]) -> list[int]:
        """Give each sequence a slot and write its parameters (and, with penalties, its token counts so far)."""
        self._last = None
        dev = self.device
        slots = [self.slots.take() for _ in seqs]
        self.params = _grown(self.params, self.slots.high)
        values = [x for seq in seqs for x in _param_row(seq.sampling_params, self.vocab_size)]
        self.params[host_tensor(slots, torch.int64, dev)] = host_tensor(values, torch.float32, dev).view(-1, 7)
        rows, output_ids, output_lens, prompt_ids, prompt_lens = [], [], [], [], []
        for seq, slot in zip(seqs, slots):
            if not seq.sampling_params.needs_output_token_ids:
                continue
            tokens, num_prompt = seq.token_ids, seq.num_prompt_tokens
            # a placeholder can only be the last token (one step in flight); the engine must not let it get here
            assert tokens[-1] != PLACEHOLDER_TOKEN, f"request {seq.request_id} uses penalties but a token is in flight"
            rows.append(self.penalty_rows.take())
            self.penalty_row_of[slot] = rows[-1]
            output_ids += tokens[num_prompt:]
            output_lens.append(len(tokens) - num_prompt)
            repeat = seq.sampling_params.repetition_penalty != 1
            prompt_ids += tokens[:num_prompt] if repeat else []
            prompt_lens.append(num_prompt if repeat else 0)
        if rows:
            self.counts = _grown(self.counts, self.penalty_rows.high)
            self.prompt_seen = _grown(self.prompt_seen, self.penalty_rows.high)
            index = host_tensor(rows, torch.int64, dev)
            self.counts[index] = 0
            self.prompt_seen[index] = False
            out_rows = index.repeat_interleave(host_tensor(output_lens, torch.int64, dev), output_size=len(output_ids))
            out_ids = host_tensor(output_ids, torch.int64, dev)
            self.counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True)
            p_rows = index.repeat_interleave(host_tensor(prompt_lens, torch.int64, dev), output_size=len(prompt_ids))
            self.prompt_seen[p_rows, host_tensor(prompt_ids, torch.int64, dev)] = True
        return slots

    def remove(self, slots: list[int]) -> None:
        """Free the slots of requests that left (and the count tables once no request with penalties is left)."""
        self._last = None
        self.slots.free += slots
        self.penalty_rows.free += [self.penalty_row_of.pop(slot) for slot in slots if slot in self.penalty_row_of]
        if not self.penalty_row_of and self.penalty_rows.high:
            self.counts, self.prompt_seen = self.counts[:0].clone(), self.prompt_seen[:0].clone()
            self.penalty_rows = _Rows()

    def batch(self, seqs: list[Sequence], slots: list[int]) -> SamplingBatch:
        """The step's sampling parameters: the rows ``slots`` of ``seqs`` (reused while the slots stay the same);
        the logit adjustments follow each sequence's output so far, so they are built for every step."""
        if self._last is None or self._last[0] != slots:
            adjusted = [i for i, seq in enumerate(seqs) if seq.sampling_params.adjusts_logits]
            self._last = (slots, self._gather(seqs, slots), adjusted)
        _, batch, adjusted = self._last
        if adjusted:
            adjustments = LogitAdjustments.from_seqs(seqs, adjusted, self.vocab_size, self.device)
            batch = dataclasses.replace(batch, adjustments=adjustments)
        return batch

    def _gather(self, seqs: list[Sequence], slots: list[int]) -> SamplingBatch:
        params = [seq.sampling_params for seq in seqs]
        dev = self.device
        columns = self.params[host_tensor(slots, torch.int64, dev)].T.contiguous()  # [7, rows]
        num_greedy = sum(p.temperature == 0 for p in params)
        all_greedy = num_greedy == len(params)
        top_k = top_p = min_p = None
        if not all_greedy and any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            top_k = columns[1].long() if any(p.top_k > 0 for p in params) else None
            top_p = columns[2] if any(p.top_p < 1 for p in params) else None
            min_p = columns[3] if any(p.min_p > 0 for p in params) else None
        penalties = None
        rows = [i for i, p in enumerate(params) if p.needs_output_token_ids]
        if rows:
            index = host_tensor(rows, torch.int64, dev)
            table_rows = host_tensor([self.penalty_row_of[slots[i]] for i in rows], torch.int64, dev)
            presence, frequency, repetition = columns[4:][:, index]
            penalties = Penalties(index, presence, frequency, repetition, table_rows, self.counts, self.prompt_seen)
        num_logprobs: list[int | None] | None = [p.logprobs for p in params]
        if num_logprobs.count(None) == len(params):
            num_logprobs = None
        generators = [seq.generator for seq in seqs]
        return SamplingBatch(
            columns[0], top_k, top_p, min_p, generators, all_greedy, num_greedy > 0, penalties, num_logprobs
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
        """One token id per row (int64); ``logits`` itself is not modified."""
        if batch.adjustments is not None:
            logits = batch.adjustments.apply(logits)
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        if self._use_kernel(logits, batch):
            seed = self._kernel_seeds.getrandbits(31)
            return kernel_module("sampling_kernel").sample_temperature(logits, batch.temperatures, seed)
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
    def warmup(logits: torch.Tensor) -> None:
        """Compile the sampling kernel's variants for logits like these (the model's) now, at start-up, instead
        of in the first requests whose row counts need them."""
        kernels = kernel_module("sampling_kernel")
        if logits.is_cuda and fused_enabled() and kernels is not None:
            kernels.warmup(logits)

    @staticmethod
    def _use_kernel(logits: torch.Tensor, batch: SamplingBatch) -> bool:
        eligible = logits.is_cuda and fused_enabled() and kernel_eligible(batch)
        return eligible and kernel_module("sampling_kernel") is not None

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


@dataclass
class SampleLogprobs:
    """The logprob of one chosen token (a sampled one, or the next prompt token) and the most likely tokens'.

    ``rank`` is 1 + the number of tokens more likely than the chosen one (vLLM: how many tokens have a logprob
    at least as high); ``top_ids`` / ``top_logprobs`` hold the ``k`` most likely tokens, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class LogprobsTensors:
    """:class:`SampleLogprobs` of several rows as tensors (on the device until copied)."""

    token_ids: torch.Tensor  # int64 [rows]
    logprobs: torch.Tensor  # float32 [rows]
    ranks: torch.Tensor  # int64 [rows]
    top_ids: torch.Tensor  # int64 [rows, k]
    top_logprobs: torch.Tensor  # float32 [rows, k]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LogprobsTensors:
        return LogprobsTensors(*(fn(getattr(self, f.name)) for f in fields(self)))

    @staticmethod
    def cat(parts: list[LogprobsTensors]) -> LogprobsTensors:
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(LogprobsTensors)))

    def tolist(self, num_top: list[int]) -> list[SampleLogprobs]:
        """One entry per row, row ``i`` keeping its ``num_top[i]`` best tokens (reads host tensors)."""
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            SampleLogprobs(token, logprob, rank, ids[:k], lps[:k])
            for token, logprob, rank, ids, lps, k in zip(
                self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(), top_ids, top_logprobs, num_top
            )
        ]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprobs of ``token_ids[i]`` under row ``i`` of ``logits`` (``log_softmax`` in float32 of the raw
    logits, vLLM's default), their ranks and each row's ``num_top`` most likely tokens; no host sync."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(token_ids, chosen.squeeze(1), ranks, top_ids, top_logprobs)
