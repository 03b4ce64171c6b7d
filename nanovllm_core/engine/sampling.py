"""A step's sampled tokens and logprobs on their way to the host (:class:`PendingStep`), and the logprobs the
runner computes for them and for prompt tokens."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nanovllm_core.engine.input_batch import PromptLogprobsPlan
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.interfaces import SchedulerOutput
from nanovllm_core.layers.sampler import LogprobsTensors, SampleLogprobs, compute_logprobs

LOGPROBS_SLICE = 256  # logprobs are computed this many rows at a time: a [rows, vocab] float32 each


@dataclass
class RowsLogprobs:
    """Logprobs one step computed for some rows of its batch: ``counts[i]`` consecutive entries for row
    ``rows[i]`` (1 for a sampled token, one per prompt token scored), each keeping ``num_top[i]`` top tokens."""

    rows: list[int]
    counts: list[int]
    num_top: list[int]
    tensors: LogprobsTensors

    def per_row(self) -> dict[int, list[SampleLogprobs]]:
        entries = self.tensors.tolist([k for k, c in zip(self.num_top, self.counts) for _ in range(c)])
        out, i = {}, 0
        for row, count in zip(self.rows, self.counts):
            out[row] = entries[i : i + count]
            i += count
        return out


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class PendingStep:
    """A launched step: its sampled tokens (and logprobs, where asked) are on their way to the host (copies
    queued at launch, one synchronisation when first read).

    ``wants_logprobs`` / ``wants_prompt_logprobs``: whether :meth:`logprobs` / :meth:`prompt_logprobs` have
    anything to return (some row's request asked). ``prompt_positions[row]`` is the prompt position of the first
    entry of ``prompt_logprobs()[row]``: the same positions come again if the sequence is recomputed after a
    preemption.
    """

    def __init__(
        self,
        batch: SchedulerOutput,
        sample_rows: list[int],
        token_tensor: torch.Tensor | None,
        sample_logprobs: RowsLogprobs | None = None,
        prompt_logprobs: RowsLogprobs | None = None,
        prompt_positions: dict[int, int] | None = None,
        embeddings: tuple[list[int], torch.Tensor] | None = None,
    ) -> None:
        self.batch = batch
        self.sample_rows = sample_rows
        self.token_tensor = token_tensor
        # where each sampled sequence's token sits in token_tensor, for the next step's placeholder inputs
        self.row_of_seq = {batch.seqs[row].seq_id: i for i, row in enumerate(sample_rows)}
        self.prompt_positions = prompt_positions or {}
        self.wants_logprobs = sample_logprobs is not None
        self.wants_prompt_logprobs = prompt_logprobs is not None
        self.wants_embeddings = embeddings is not None
        self._embeddings = embeddings  # (batch rows, float32 [rows, hidden]) of the rows whose requests embed
        self._host = token_tensor
        self._logprobs = (sample_logprobs, prompt_logprobs)
        self._copied: torch.cuda.Event | None = None
        outputs = [lp.tensors.logprobs for lp in self._logprobs if lp is not None]
        if token_tensor is not None:
            outputs.append(token_tensor)
        if outputs and outputs[0].is_cuda:
            if token_tensor is not None:
                self._host = _pinned_copy(token_tensor)
            for lp in self._logprobs:
                if lp is not None:
                    lp.tensors = lp.tensors.map(_pinned_copy)
            if embeddings is not None:
                self._embeddings = (embeddings[0], _pinned_copy(embeddings[1]))
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def tokens(self) -> list[int | None]:
        """The sampled token of each row of the batch, ``None`` for rows that sample nothing (waits for the
        device: the step's one synchronisation)."""
        sampled: list[int | None] = [None] * len(self.batch.seqs)
        if self._host is None:
            return sampled
        self._wait()
        for row, token in zip(self.sample_rows, self._host.tolist()):
            sampled[row] = token
        return sampled

    def logprobs(self) -> list[SampleLogprobs | None]:
        """The sampled token's logprobs for each row of the batch whose request asks ``logprobs``; ``None`` for
        the other rows and for rows that sample nothing."""
        out: list[SampleLogprobs | None] = [None] * len(self.batch.seqs)
        if self._logprobs[0] is not None:
            self._wait()
            for row, entries in self._logprobs[0].per_row().items():
                out[row] = entries[0]
        return out

    def embeddings(self) -> dict[int, list[float]]:
        """For each row whose request asks ``embed``: its last prompt token's final hidden state, L2-normalised."""
        if self._embeddings is None:
            return {}
        self._wait()
        rows, vectors = self._embeddings
        return dict(zip(rows, vectors.tolist()))

    def prompt_logprobs(self) -> dict[int, list[SampleLogprobs]]:
        """For each row whose request asks ``prompt_logprobs`` and whose chunk scored prompt tokens: one entry
        per prompt token from position ``prompt_positions[row]`` on, each given the tokens before it."""
        if self._logprobs[1] is None:
            return {}
        self._wait()
        return self._logprobs[1].per_row()


def sample_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None], sample_rows: list[int]
) -> RowsLogprobs:
    """Logprobs of the sampled tokens of the rows whose request asks ``logprobs`` (``logits``: raw)."""
    asked = [i for i, k in enumerate(num_logprobs) if k is not None]
    num_top = [k for k in num_logprobs if k is not None]
    if len(asked) < len(num_logprobs):
        index = host_tensor(asked, torch.int64, logits.device)
        logits, tokens = logits[index], tokens[index]
    k, n = max(num_top), LOGPROBS_SLICE
    parts = [compute_logprobs(logits[i : i + n], tokens[i : i + n], k) for i in range(0, len(asked), n)]
    return RowsLogprobs([sample_rows[i] for i in asked], [1] * len(asked), num_top, LogprobsTensors.cat(parts))


def score_prompts(
    prompt_logits: Iterable[torch.Tensor], plan: PromptLogprobsPlan, device: torch.device
) -> RowsLogprobs:
    """Logprobs of the prompt tokens ``plan`` scores, from their logits (``LOGPROBS_SLICE`` rows at a time)."""
    targets = host_tensor(plan.targets, torch.int64, device)
    k, n = max(plan.num_top), LOGPROBS_SLICE
    parts = [compute_logprobs(logits, targets[i * n : (i + 1) * n], k) for i, logits in enumerate(prompt_logits)]
    return RowsLogprobs(plan.rows, plan.counts, plan.num_top, LogprobsTensors.cat(parts))
