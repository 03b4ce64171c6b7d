"""The four plugin interfaces. A plugin registers a class that implements one of them.

Each docstring states the invariants the engine relies on; ``nanovllm_testing`` checks them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from nanovllm_core.config import EngineConfig
from nanovllm_core.errors import ConfigError
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.sequence import Sequence, SequenceStatus


def _reject_options(plugin: object, kind: str, options: dict[str, Any]) -> None:
    """Options that reach a base class were consumed by no subclass: they are misspelt or unsupported."""
    if options:
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
        computed so that the model produces logits for it. Always 0 when ``seq.reads_prefix_cache`` is False
        (a request that needs every prompt position computed, such as one asking prompt logprobs); ``allocate``
        then claims nothing either.
        """

    @abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq.block_table`` cover its first ``seq.num_computed_tokens + num_new_tokens`` tokens, counting
        ``num_computed_tokens`` as it was before the call; return ``False`` and change nothing when the free blocks
        do not suffice.

        With an empty block table (``num_computed_tokens`` is 0) the cached prefix is claimed first and
        ``num_computed_tokens`` advanced past it; ``num_new_tokens`` still counts from 0, so the table covers
        ``max(cached prefix, num_new_tokens)`` tokens. Schedulers usually call
        :meth:`Scheduler.allocate_chunk`, which does the arithmetic.
        """

    def allocate_many(self, seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
        """Optional fast path for a step's running sequences, which all hold blocks already: ``allocate(seq, n)``
        for each pair in order, all or nothing. ``True`` when every one got its blocks; ``False`` with nothing
        changed when the free blocks do not suffice, or to decline (the default), and the scheduler then calls
        ``allocate`` one sequence at a time."""
        return False

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and clear its block table (idempotent)."""

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Called after each step: make the blocks the step filled findable by later lookups. Optional."""


# ----------------------------------------------------------------------------------------------------
# Scheduler
# ----------------------------------------------------------------------------------------------------


@dataclass
class SchedulerOutput:
    """One step's work: which sequences run and how many new tokens each computes.

    Sequence ``i`` computes tokens ``[seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens[i])``.
    Any mix is allowed: prompt chunks next to single decode tokens. A token is sampled for each
    sequence whose chunk reaches its last token. ``preempted`` lists the sequences this step preempted
    (informational: they hold no blocks any more).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # set by the engine, not the scheduler: (rows of ``seqs`` whose sampling a grammar constrains, int32 bitmask
    # of their allowed tokens, one row each; see nanovllm_core.structured_output)
    grammar_bitmask: tuple[list[int], Any] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def total_new_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens


class Scheduler(ABC):
    """A scheduling policy: each step, which sequences run and how many new tokens each computes.

    The engine owns the requests (ids, validation, the fit check against the KV cache and ``max_model_len``,
    stop decisions, finish reasons, aborts, outputs). This base class owns the queues' bookkeeping:

    - ``waiting`` (a deque, arrival order) holds added sequences; ``running`` (a dict ``seq_id -> seq`` in
      admission order) holds admitted ones. A policy moves a sequence from one to the other with :meth:`admit`
      (after taking it out of ``waiting`` itself). Sequences may hold KV blocks in either.
    - :meth:`add`, :meth:`postprocess`, :meth:`finish` and :meth:`preempt` are the mechanism the engine and
      policies call; a policy normally overrides none of them.
    - :meth:`allocate_chunk` is how a policy gets KV blocks for a prompt chunk (it claims a cached prefix on
      first admission); ``block_manager.allocate(seq, 1)`` is enough for a decode token.

    A policy writes :meth:`schedule` and, to keep ``waiting`` in another order, the small queue hooks
    :meth:`enqueue` (a new request), :meth:`requeue` (a preempted one) and :meth:`remove_waiting`.

    Invariants of ``schedule`` (the engine checks them every step and names the plugin that broke one):
    - at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` new tokens; each sequence once, with
      ``1 <= num_new_tokens <= seq.num_uncomputed_tokens`` and blocks that cover them;
    - it returns an empty output only when nothing can run (every waiting sequence fits an empty cache, so
      with no sequence running an empty output while sequences wait is a bug);
    - no waiting sequence is starved forever while others finish.

    Async scheduling is invisible here: a sequence's last token may be
    :data:`~nanovllm_core.sequence.PLACEHOLDER_TOKEN` (sampled on the device, not read yet); a policy reads
    lengths and counts, never token values.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, **options: Any) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.num_preemptions = 0
        _reject_options(self, "scheduler", options)

    # --- the policy -----------------------------------------------------------------------------------

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and their new-token counts, allocating their blocks."""

    # --- queue hooks (override to keep ``waiting`` in another order) ----------------------------------

    def enqueue(self, seq: Sequence) -> None:
        """Put a new sequence in ``waiting``."""
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a preempted sequence back in ``waiting`` (default: at its head, to be recomputed first)."""
        self.waiting.appendleft(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        """Take ``seq`` out of ``waiting`` (it finished or was aborted before being admitted)."""
        self.waiting.remove(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- mechanism ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new sequence; the engine has validated it and checked it fits the cache."""
        seq.status = SequenceStatus.WAITING
        self.enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def admit(self, seq: Sequence) -> None:
        """Move ``seq``, already taken out of ``waiting`` by the policy, to ``running``."""
        seq.status = SequenceStatus.RUNNING
        self.running[seq.seq_id] = seq

    def allocate_chunk(self, seq: Sequence, budget: int, *, whole_prompt: bool = False) -> int:
        """Blocks for ``seq``'s next chunk of at most ``budget`` tokens; returns the chunk's size, 0 when the
        cache has no room (nothing changed then).

        On first admission (empty block table) this claims the cached prefix, so the chunk starts after it.
        ``whole_prompt=True`` reserves blocks for every uncomputed token now, whatever the chunk size.
        """
        bm = self.block_manager
        if seq.block_table:
            n = min(seq.num_uncomputed_tokens, budget)
            return n if bm.allocate(seq, seq.num_uncomputed_tokens if whole_prompt else n) else 0
        cached = bm.num_cached_tokens(seq)
        n = min(seq.num_tokens - cached, budget)
        # num_computed_tokens is 0 here; allocate claims the cached prefix and covers the first ``want`` tokens
        want = seq.num_tokens if whole_prompt else cached + n
        if n <= 0 or not bm.allocate(seq, want):
            return 0
        return n

    def allocate_or_preempt(
        self, seq: Sequence, budget: int, victims: deque[Sequence], out: SchedulerOutput
    ) -> int:
        """:meth:`allocate_chunk` for a running ``seq``, preempting ``victims.pop()`` (the end of the deque: put the
        sequences to sacrifice first there) until it fits. Returns the chunk size, or 0 when ``seq`` itself had
        to be preempted; every preempted sequence is listed in ``out.preempted``."""
        while not (n := self.allocate_chunk(seq, budget)):
            if self._preempt_victim(seq, victims, out):
                return 0
        return n

    def _preempt_victim(self, seq: Sequence, victims: deque[Sequence], out: SchedulerOutput) -> bool:
        """Preempt ``victims.pop()``, or ``seq`` itself when none is left; True when that was ``seq``."""
        victim = victims.pop() if victims else seq
        self.preempt(victim)
        out.preempted.append(victim)
        return victim is seq

    def schedule_running(
        self, out: SchedulerOutput, budget: int, order: Iterable[Sequence] | None = None, chunk_cap: int = 0
    ) -> int:
        """Serve the running sequences first: each gets its decode token or the next chunk of its prompt (at most
        ``chunk_cap`` tokens when > 0), in ``order`` (default: admission order); when the cache is full the last
        ones in that order not served yet are preempted. Adds to ``out``; returns the budget left."""
        queue = list(self.running.values() if order is None else order)
        seqs, counts = out.seqs, out.num_new_tokens
        max_num_seqs = self.max_num_seqs
        # Every running sequence passes here every step: a sequence with blocks gets them from the block manager
        # directly (what allocate_chunk does for it), unless a subclass changed allocate_chunk.
        bm = self.block_manager
        allocate = bm.allocate if type(self).allocate_chunk is Scheduler.allocate_chunk else None
        if allocate is not None and type(bm).allocate_many is not BlockManager.allocate_many and budget > 0:
            # Each of the first seats' sequences holding blocks and its whole rest fitting the budget and the cap, the
            # loop below would give each its rest unless the cache runs out: one call to the block manager instead.
            served = queue[: max(0, max_num_seqs - len(seqs))]
            rest = [len(seq.token_ids) - seq.num_computed_tokens if seq.block_table else 0 for seq in served]
            total = sum(rest)
            if (
                served
                and total <= budget
                and min(rest) > 0
                and (not chunk_cap or max(rest) <= chunk_cap)
                and bm.allocate_many(served, rest)
            ):
                seqs += served
                counts += rest
                return budget - total
        queue = deque(queue)
        while queue and budget > 0 and len(seqs) < max_num_seqs:
            seq = queue.popleft()
            cap = chunk_cap if chunk_cap and chunk_cap < budget else budget
            if allocate is not None and seq.block_table:
                n = len(seq.token_ids) - seq.num_computed_tokens
                if n > cap:
                    n = cap
                if not allocate(seq, n) or not n:  # no room: preempt, then allocate_or_preempt's loop
                    n = 0 if self._preempt_victim(seq, queue, out) else self.allocate_or_preempt(seq, cap, queue, out)
            else:
                n = self.allocate_or_preempt(seq, cap, queue, out)
            if n:
                seqs.append(seq)
                counts.append(n)
                budget -= n
        return budget

    def schedule_waiting(self, out: SchedulerOutput, budget: int, chunk_cap: int = 0) -> int:
        """Admit sequences from the head of ``waiting`` (a deque: the default queue), each with its first prompt
        chunk (at most ``chunk_cap`` tokens when > 0), while seats (``max_num_seqs``), budget and blocks last.
        Adds to ``out``; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self.allocate_chunk(self.waiting[0], min(budget, chunk_cap or budget))
            if not n:
                break
            seq = self.waiting.popleft()
            self.admit(seq)
            out.add(seq, n)
            budget -= n
        return budget

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the running ``seq``'s blocks and put it back with :meth:`requeue`."""
        del self.running[seq.seq_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.requeue(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and free its blocks (the engine calls this on stop and abort)."""
        if self.running.pop(seq.seq_id, None) is None:
            self.remove_waiting(seq)
        self.block_manager.free(seq)

    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> None:
        """After a step: advance ``num_computed_tokens``, let the block manager index the blocks the step filled
        and append each sampled token (``None``: a prompt chunk short of the end samples nothing).

        Tokens are :data:`~nanovllm_core.sequence.PLACEHOLDER_TOKEN` until the engine reads them from the device.
        """
        bm = self.block_manager
        block_size = bm.block_size
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, sampled_token_ids):
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + num_new
            if after // block_size != before // block_size:
                bm.cache_full_blocks(seq)
            if token_id is not None:
                seq.token_ids.append(token_id)


# ----------------------------------------------------------------------------------------------------
# Attention backend
# ----------------------------------------------------------------------------------------------------


@dataclass
class AttentionBatch:
    """The backend-independent description of one step (tensors on the device, plus host copies of the lengths).

    Sequence ``i`` owns query tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened batch;
    after this step its context holds ``seq_lens[i]`` tokens, the first ``seq_lens[i] - query_len`` of which
    were already in the cache. ``slot_mapping[t]`` is where token ``t``'s key and value go in the cache
    (``block * block_size + offset``), ``-1`` for padding that must not be stored. ``max_seq_len`` is at least
    every ``seq_lens[i]``.

    Made by :meth:`build` (or :meth:`from_spans`), everywhere: the model runner, CUDA-graph capture, the
    profile run and the test kits. A CUDA-graph batch is built once per batch size and its tensors are refilled
    before each replay of a pure-decode step: its ``max_seq_len`` is ``max_model_len`` and its host lists keep
    the capture-time values (``query_start_loc_cpu`` stays right, one token per row; ``seq_lens_cpu`` are 0),
    so a backend with ``supports_cuda_graph`` must not read ``seq_lens_cpu`` when ``max_query_len <= 1``.
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

    @classmethod
    def build(
        cls,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        slot_mapping: list[int] | torch.Tensor,
        block_size: int,
        device: torch.device,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
    ) -> AttentionBatch:
        """The batch of these host lengths (kept as the ``*_cpu`` fields, copied to ``device`` without blocking).

        ``block_tables`` as lists are padded with 0 to the longest; ``slot_mapping`` as a list becomes int64.
        The scalars come from the lengths; a caller that knows ``max_query_len`` passes it (saves a pass), and
        ``max_seq_len`` may be an upper bound (CUDA-graph capture).
        """
        num_seqs = len(seq_lens)
        if not isinstance(block_tables, torch.Tensor):
            width = max(map(len, block_tables), default=0)
            flat = [b for table in block_tables for b in (*table, *[0] * (width - len(table)))]
            block_tables = host_tensor(flat, torch.int32, device).view(num_seqs, width)
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = host_tensor(slot_mapping, torch.int64, device)
        if max_query_len is None:
            max_query_len = max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])), default=0)
        return cls(
            query_start_loc=host_tensor(query_start_loc, torch.int32, device),
            seq_lens=host_tensor(seq_lens, torch.int32, device),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens, default=0) if max_seq_len is None else max_seq_len,
            num_seqs=num_seqs,
            num_tokens=query_start_loc[-1],
            block_size=block_size,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )

    @classmethod
    def from_spans(
        cls, block_tables: list[list[int]], spans: list[tuple[int, int]], block_size: int, device: torch.device
    ) -> AttentionBatch:
        """The batch in which sequence ``i`` (blocks ``block_tables[i]``) computes positions ``spans[i] =
        (start, end)``, its first ``start`` tokens being in the cache already."""
        query_start_loc, slots = [0], []
        for table, (start, end) in zip(block_tables, spans):
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + end - start)
        return cls.build(query_start_loc, [end for _, end in spans], block_tables, slots, block_size, device)

    def head(self, num_seqs: int) -> AttentionBatch:
        """The first ``num_seqs`` sequences, as views of this batch's tensors (``max_seq_len`` kept: a bound)."""
        query_start_loc = self.query_start_loc_cpu[: num_seqs + 1]
        return AttentionBatch(
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            slot_mapping=self.slot_mapping[: query_start_loc[-1]],
            max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])), default=0),
            max_seq_len=self.max_seq_len,
            num_seqs=num_seqs,
            num_tokens=query_start_loc[-1],
            block_size=self.block_size,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=self.seq_lens_cpu[:num_seqs],
        )


class AttentionBackend(ABC):
    """Paged attention over the KV cache, for every attention layer of the model.

    One instance serves the whole model; ``forward`` is called once per layer with that layer's cache.
    ``forward`` first stores ``k``/``v`` at ``metadata``'s slots, then attends each query token to its
    sequence's context up to and including its own position (causal).
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0  # `auto` picks the available backend with the highest priority
    supports_cuda_graph: ClassVar[bool] = False
    # steps with prompt tokens captured too (``build_graph_metadata``); needs ``supports_cuda_graph``
    supports_cuda_graph_mixed: ClassVar[bool] = False

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

    @classmethod
    def check_kv_cache_dtype(cls, kv_cache_dtype: str, device: torch.device) -> str | None:
        """``None`` if the backend can keep its cache in ``kv_cache_dtype`` on ``device``, else why not (shown to
        the user). ``EngineConfig.kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"fp8"`` (float8 e4m3 with
        scales of the backend's choosing). The default accepts ``"auto"`` only."""
        if kv_cache_dtype == "auto":
            return None
        return f"kv_cache_dtype {kv_cache_dtype!r} is not supported (supported: 'auto')"

    @classmethod
    def kv_cache_spec(
        cls,
        kv_cache_dtype: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and element type of one layer's cache for a ``kv_cache_dtype`` that ``check_kv_cache_dtype``
        accepted (``dtype``: the model's). The runner allocates zeros of ``(num_layers, *shape)`` and hands layer
        ``i``'s slice to ``forward``; the shape must grow linearly with ``num_blocks``. Default:
        ``kv_cache_shape(...)`` in ``dtype``. A backend whose ``"fp8"`` cache differs must still accept a cache
        of ``kv_cache_shape`` in the model's dtype (the runner's memory-profiling forward uses one)."""
        return cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype

    def warmup(self, kv_cache: torch.Tensor) -> None:
        """Optional: compile and load every kernel variant ``forward`` can meet on caches like ``kv_cache`` (one
        layer's), so that the first requests run at steady speed. The runner calls it once, after allocating the
        KV cache and before capturing CUDA graphs; the cache's contents must stay unchanged. Default: nothing."""

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
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        model = getattr(type(self), "Options", None)  # a pydantic model of the options, if the class has one
        try:
            self.options = _reject_options(self, "attention", options) if model is None else model(**options)
        except ValueError as exc:  # pydantic's ValidationError
            raise ConfigError(f"invalid plugins.attention_options for {type(self).__name__}: {exc}") from None

    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Turn the runner's batch description into whatever ``forward`` needs (called once per step)."""
        return batch

    def build_graph_metadata(self, batch: AttentionBatch) -> Any:
        """Metadata for a CUDA graph that replays steps with prompt tokens (``supports_cuda_graph_mixed``).

        ``batch`` is a static batch of ``num_tokens`` tokens over ``num_seqs`` sequence rows, built once per
        token bucket; before each replay the runner refills its tensors with a step of at most that many tokens
        and rows, with any mix of query lengths: rows past the step's are padding (query length 0, ``seq_lens``
        0) and tokens past the step's belong to no sequence (``query_start_loc[-1]`` is the step's token count;
        their slots are -1). ``forward`` must attend the step's tokens exactly as for that step's own batch,
        leave the others alone (their output rows are never read), read no host list of ``batch`` (they keep
        the capture-time values) and make no host-device sync. Default: not supported."""
        raise NotImplementedError(f"the {self.name!r} backend does not capture steps with prompt tokens")

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

