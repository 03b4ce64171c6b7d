"""``shortest_prompt_first``: admit the waiting request with the shortest prompt first, with aging.

Each step is either a prefill step or a decode step:

1. Prefill. The prompt cut into chunks by the previous step continues first; then requests that were
   preempted, in the order they were preempted; then waiting requests by *score*
   ``prompt tokens - aging * steps waited``. Admission stops when ``max_num_seqs`` requests hold blocks,
   the token budget is spent, or the KV cache has no room. Only the first prompt of a step is cut into a
   chunk; the others must fit whole.
2. Decode, when there is no prefill work: one token for every running request, oldest first. When the KV
   cache has no block for a decode token, the most recently admitted request is preempted: its blocks are
   freed and it is recomputed later.

Aging prevents starvation: every waiting request gains ``aging`` tokens of priority per step, so a long
prompt overtakes newer short ones after (its length - theirs) / aging steps. Since all waiting requests age
at the same rate, the order by score equals the order by the fixed key ``prompt tokens + aging * arrival
step``, which a heap keeps in O(log n) per request.
"""

from __future__ import annotations

import heapq
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from nanovllm_core import BlockManager, EngineConfig, Scheduler, SchedulerOutput, Sequence


class ShortestPromptFirstScheduler(Scheduler):
    class Options(BaseModel):
        """``[plugins] scheduler_options`` accepted by this scheduler."""

        model_config = ConfigDict(extra="forbid")
        aging: float = Field(1.0, ge=0, description="Tokens of priority a waiting request gains per step.")

    def __init__(self, config: EngineConfig, block_manager: BlockManager, aging: float = 1.0) -> None:
        super().__init__(config, block_manager)
        self.aging = aging
        self.steps = 0
        self.by_score: list[tuple[float, int, Sequence]] = []  # heap of (key, seq_id, seq)
        self.preempted: deque[Sequence] = deque()  # hold no blocks; recomputed before new requests
        self.chunked: Sequence | None = None  # the prompt cut into chunks, continued first

    # --- queue hooks: ``waiting`` is the preempted deque plus the score heap ------------------------------

    def enqueue(self, seq: Sequence) -> None:
        heapq.heappush(self.by_score, (seq.num_prompt_tokens + self.aging * self.steps, seq.seq_id, seq))

    def requeue(self, seq: Sequence) -> None:
        self.preempted.append(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        if seq in self.preempted:
            self.preempted.remove(seq)
        else:
            self.by_score = [entry for entry in self.by_score if entry[2] is not seq]
            heapq.heapify(self.by_score)

    @property
    def num_waiting(self) -> int:
        return len(self.preempted) + len(self.by_score)

    def _peek(self) -> Sequence | None:
        if self.preempted:
            return self.preempted[0]
        return self.by_score[0][2] if self.by_score else None

    def _pop(self) -> Sequence:
        return self.preempted.popleft() if self.preempted else heapq.heappop(self.by_score)[2]

    # --- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        if self.chunked is not None and self.chunked.seq_id not in self.running:
            self.chunked = None  # finished or aborted
        out = self._prefill()
        if not out.seqs:  # decode: every running request, the most recently admitted preempted first
            self.schedule_running(out, self.max_num_batched_tokens)
        return out

    def _prefill(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.chunked is not None:
            seq = self.chunked
            n = min(seq.num_uncomputed_tokens, budget)
            out.add(seq, n)
            budget -= n
            if seq.num_computed_tokens + n == seq.num_tokens:
                self.chunked = None
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._peek()
            if seq is None:
                break
            remaining = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if remaining > budget and out.seqs:
                break  # only the first prompt of a step is cut into a chunk
            n = self.allocate_chunk(seq, budget, whole_prompt=True)
            if not n:
                break  # no room in the KV cache: wait until running requests free blocks
            self.admit(self._pop())
            if n < seq.num_uncomputed_tokens:
                self.chunked = seq
            out.add(seq, n)
            budget -= n
        return out
