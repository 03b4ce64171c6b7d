"""The four plugin interfaces. A plugin registers a class that implements one of them.

Each docstring states the invariants the engine relies on; ``nanovllm_core.testing`` checks them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from nanovllm_core.config import EngineConfig
from nanovllm_core.sequence import Sequence, SequenceStatus


def _reject_options(plugin: object, kind: str, options: dict[str, Any]) -> None:
    """Options that reach a base class were consumed by no subclass: they are misspelt or unsupported."""
    if options:
        from nanovllm_core.errors import ConfigError

        raise ConfigError(
            f"plugins.{kind}_options {sorted(options)} not accepted by {type(plugin).__name__}; declare them in "
            "its `Options` model or its __init__"
        )


# ----------------------------------------------------------------------------------------------------
# Block manager
# ----------------------------------------------------------------------------------------------------


class BlockManager(ABC):
    """Owns the KV-cache blocks: which sequence holds which block, and which blocks can be shared.

    Invariants:
    - a block is either free or referenced by at least one sequence's ``block_table``;
    - ``allocate`` is all-or-nothing: on ``False`` nothing changed;
    - once every sequence has been ``free``-d, ``num_free_blocks == num_blocks``;
    - a block that a cache lookup hands out holds exactly the KV of the tokens it was hashed for.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, **options: Any):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        _reject_options(self, "block_manager", options)

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (cached-but-unreferenced blocks count as free)."""

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @abstractmethod
    def num_cached_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of a sequence with no blocks yet are in the prefix cache (no side effects).

        Always a multiple of ``block_size`` and always less than ``seq.num_tokens``: the last token is
        computed so that the model produces logits for it.
        """

    @abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` the blocks to hold ``seq.num_computed_tokens + num_new_tokens`` tokens.

        For a sequence with an empty block table this first claims its cached prefix and advances
        ``seq.num_computed_tokens`` past it (``num_new_tokens`` counts from the old value, so asking for
        ``seq.num_uncomputed_tokens`` always covers the whole sequence). Returns ``False`` and changes
        nothing when there are not enough free blocks.
        """

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and clear its block table (idempotent)."""

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Called after each step: make the blocks the step filled findable by later lookups. Optional."""

    def stats(self) -> dict[str, int]:
        return {"num_blocks": self.num_blocks, "num_free_blocks": self.num_free_blocks}


# ----------------------------------------------------------------------------------------------------
# Scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass
class SchedulerOutput:
    """One step's work: which sequences run and how many new tokens each computes.

    Sequence ``i`` computes tokens ``[seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens[i])``.
    Any mix is allowed: prompt chunks next to single decode tokens. A token is sampled for each
    sequence whose chunk reaches its last token.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_new_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens


StopChecker = Callable[[Sequence], "str | None"]


class Scheduler(ABC):
    """Decides each step which sequences run and how many tokens each computes.

    The engine calls ``add`` for new requests, then repeatedly ``schedule`` -> model -> ``postprocess``.

    Invariants:
    - a step never holds more than ``config.max_num_seqs`` sequences or ``config.max_num_batched_tokens``
      new tokens, and every scheduled sequence has the blocks its new tokens need (``BlockManager.allocate``);
    - ``schedule`` returns an empty output only when there is nothing to run;
    - ``add`` raises :class:`~nanovllm_core.errors.InvalidRequestError` for a request that can never be
      scheduled (it would never fit the KV cache), leaving the scheduler unchanged;
    - ``postprocess`` advances ``num_computed_tokens``, calls ``block_manager.cache_full_blocks(seq)`` when a
      step filled a block, appends sampled tokens, asks ``stop_checker`` whether each sampled sequence is
      finished, sets ``status``/``finish_reason`` of finished ones, frees their blocks and returns them
      (:meth:`advance` does all of this for one sequence);
    - preemption frees the sequence's blocks and resets ``num_computed_tokens`` to 0 (its KV is recomputed);
    - ``abort`` of an unknown or already finished request id returns ``None``;
    - no waiting request is starved forever while others finish.

    Async scheduling (``config.async_scheduling``, on by default on CUDA): the engine calls ``postprocess``
    right after it launches a step, before the sampled tokens reach the host, with
    :data:`~nanovllm_core.sequence.PLACEHOLDER_TOKEN` for each sampled token; ``schedule`` then sees that
    placeholder as the last token of the sequence (the model runner feeds the real one on the device). Only
    the length limit can end a sequence at that point. When the real token arrives and ends the sequence
    (EOS, stop token, stop string) the engine removes it with ``abort`` and sets its finish reason. A policy
    that goes through :meth:`advance` and never reads token values needs nothing more.
    """

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, stop_checker: StopChecker, **options: Any
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        _reject_options(self, "scheduler", options)

    @abstractmethod
    def add(self, seq: Sequence) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """``sampled_token_ids[i]`` is the token sampled for ``batch.seqs[i]``, ``None`` (mid-prompt chunk) or,
        with async scheduling, ``PLACEHOLDER_TOKEN`` (the token is still on the device)."""

    @abstractmethod
    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks; returns it, or ``None`` if unknown."""

    def advance(self, seq: Sequence, num_new_tokens: int, token_id: int | None) -> bool:
        """The bookkeeping of one sequence after a step, shared by every policy; ``postprocess`` calls it.

        Advances ``num_computed_tokens``, lets the block manager index a block the step filled, appends the
        sampled token (``None``: a prompt chunk that does not reach the end samples nothing) and asks
        ``stop_checker``. Returns ``True`` when the sequence finished: its status and ``finish_reason`` are
        set and its blocks freed; the caller then drops it from its own queues.
        """
        before = seq.num_computed_tokens
        seq.num_computed_tokens = after = before + num_new_tokens
        block_size = self.block_manager.block_size
        if after // block_size != before // block_size:
            self.block_manager.cache_full_blocks(seq)
        if token_id is None:
            return False
        seq.token_ids.append(token_id)  # Sequence.append_token, inlined: this runs for every token
        reason = self.stop_checker(seq)
        if reason is None:
            return False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        return True

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    def num_unfinished(self) -> int:
        return 0


# ----------------------------------------------------------------------------------------------------
# Attention backend
# ----------------------------------------------------------------------------------------------------


@dataclass
class AttentionBatch:
    """The backend-independent description of one step, built by the model runner (tensors on device).

    Sequence ``i`` owns query tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened batch;
    after this step its context holds ``seq_lens[i]`` tokens, the first ``seq_lens[i] - query_len`` of which
    were already in the cache. ``slot_mapping[t]`` is where token ``t``'s key and value go in the cache
    (``block * block_size + offset``), ``-1`` for padding that must not be stored.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    num_tokens: int
    block_size: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Paged attention over the KV cache, for every attention layer of the model.

    One instance serves the whole model; ``forward`` is called once per layer with that layer's cache.
    ``forward`` first stores ``k``/``v`` at ``metadata``'s slots, then attends each query token to its
    sequence's context up to and including its own position (causal).
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0  # `auto` picks the available backend with the highest priority
    supports_cuda_graph: ClassVar[bool] = False

    @classmethod
    def check_available(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """``None`` if the backend runs here, else the reason it does not (shown to the user)."""
        return None

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        """KV-cache block sizes the backend handles; ``None`` means every size the config allows."""
        return None

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache; the default is ``(2, num_blocks, block_size, num_kv_heads, head_dim)``."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        **options: Any,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        _reject_options(self, "attention", options)

    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Turn the runner's batch description into whatever ``forward`` needs (called once per step)."""
        return batch

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """``q``: [num_tokens, num_heads, head_dim]; ``k``, ``v``: [num_tokens, num_kv_heads, head_dim].

        Returns [num_tokens, num_heads, head_dim].
        """


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------


@runtime_checkable
class CausalLM(Protocol):
    """What a model plugin registers (by HF architecture name): an ``nn.Module`` class with

    - ``__init__(self, hf_config)``: build the (possibly tensor-parallel) module tree; every attention layer
      is a :class:`nanovllm_core.layers.Attention`, which finds the backend through the forward context;
    - ``forward(input_ids, positions) -> hidden_states`` over a flattened batch of new tokens;
    - ``compute_logits(hidden_states) -> logits`` ([n, vocab], full vocabulary on every rank);
    - ``load_weights(weights)`` from ``(hf_name, tensor)`` pairs, slicing for the local TP rank; it raises
      :class:`~nanovllm_core.errors.ModelLoadError` naming any parameter the checkpoint did not provide.
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


ModelClass = type[nn.Module]
