from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.structured_output import StructuredOutputGrammar

PLACEHOLDER_TOKEN = -1
"""Stands in ``Sequence.token_ids`` for a token the device sampled but the host has not read yet.

With async scheduling the engine schedules step N+1 before step N's tokens reach the host: each sequence
that step N samples gets this placeholder, and the model runner feeds the real token to step N+1 on the
device. The engine writes the real token in before it checks stop conditions or returns any output.
"""


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request's token stream and its place in the KV cache.

    ``token_ids`` holds the prompt followed by every generated token. ``num_computed_tokens`` counts the
    leading tokens whose keys and values are already in the KV cache (written by an earlier step or
    found in the prefix cache); the model runner computes the next ``num_new_tokens`` from there.
    ``block_table`` lists the KV-cache blocks that hold the sequence, in order.
    """

    _counter = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.index = index  # which of the request's ``n`` samples this is
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens: int | None = None  # found in the prefix cache when first scheduled
        # False when every prompt position must be computed (prompt logprobs): block managers find no prefix
        self.reads_prefix_cache = sampling_params.prompt_logprobs is None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        self.grammar: StructuredOutputGrammar | None = None  # structured output: where this sample is in it
        if sampling_params.seed is not None:  # each of the n samples draws from its own stream
            self.generator = torch.Generator()
            self.generator.manual_seed((sampling_params.seed + index) % (1 << 64))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.request_id!r}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (the whole prompt before the first step, 1 in decode)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
