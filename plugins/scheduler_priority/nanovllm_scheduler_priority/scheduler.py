"""``priority``: requests run by ``SamplingParams.priority`` (lower value first, as in vLLM), with aging so that
nothing starves; every step is decode-first and chunked, like ``mixed``.

Urgency. A request gets a key when it arrives and keeps it, through preemptions too: with ``aging_steps = N``
greater than 0 the key is ``(priority * N + arrival_step, arrival)``, with ``N = 0`` it is
``(priority, arrival)``. ``arrival_step`` is the number of steps scheduled before the request arrived and
``arrival`` the order in which requests arrived (ties go to the earlier one). The smaller key is the more
urgent request. At step ``t`` the aging key orders requests exactly as their effective priority
``priority - (t - arrival_step) / N`` does: a request's priority improves by one level every ``N`` steps since
it arrived (linearly in between), so a request of priority ``p`` that arrived ``k * N`` steps ago ranks with a
request of priority ``p - k`` arriving now, and goes first. Because every request ages at the same rate, the
keys never change and a heap keeps the waiting requests in order.

Each step:

1. Running requests, most urgent first, get one decode token or their next prompt chunk. When the KV cache
   has no block for one, the least urgent running request not served yet in this step is preempted (its
   blocks are freed, it waits again with its key and is recomputed when readmitted); with nothing else left,
   the request preempts itself.
2. Waiting requests, most urgent first, get a prompt chunk each from the rest of the budget while seats
   (``max_num_seqs``) and blocks last. When the most urgent waiting request finds no seat or no blocks, it
   preempts running requests that are less urgent both by priority (a strictly larger value) and by key,
   least urgent first, taking back their part of this step; never one of equal or more urgent priority, and
   never one that aging has lifted above it. When no running request qualifies, admission stops for this
   step: no less urgent request goes first.
"""

from __future__ import annotations

import heapq
import itertools

from pydantic import BaseModel, ConfigDict, Field

from nanovllm_core import BlockManager, EngineConfig, Scheduler, SchedulerOutput, Sequence

Key = tuple[int, int]


class PriorityScheduler(Scheduler):
    class Options(BaseModel):
        """``[plugins] scheduler_options`` accepted by ``priority``."""

        model_config = ConfigDict(extra="forbid")
        aging_steps: int = Field(
            1000, ge=0, description="Steps after which a request's priority improves by one level; 0 turns aging off."
        )
        long_prefill_token_threshold: int = Field(
            0, ge=0, description="Most tokens one prompt chunk may take in a step; 0 leaves only the step's budget."
        )

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        aging_steps: int = 1000,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        super().__init__(config, block_manager)
        self.aging_steps = aging_steps
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.steps = 0
        self._arrivals = itertools.count()
        self.keys: dict[int, Key] = {}  # seq_id -> key, for every unfinished sequence
        self._heap: list[tuple[Key, Sequence]] = []  # keys are unique: a Sequence is never compared
        self._waiting: dict[int, Sequence] = {}  # heap entries of sequences not in here are stale

    def key(self, seq: Sequence) -> Key:
        return self.keys[seq.seq_id]

    # --- queue hooks: ``waiting`` is a heap by key ------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        priority = seq.sampling_params.priority
        primary = priority * self.aging_steps + self.steps if self.aging_steps else priority
        self.keys[seq.seq_id] = (primary, next(self._arrivals))
        self.requeue(seq)

    def requeue(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (self.keys[seq.seq_id], seq))
        self._waiting[seq.seq_id] = seq

    def remove_waiting(self, seq: Sequence) -> None:
        del self._waiting[seq.seq_id]  # its heap entry is dropped when it reaches the top, or by a rebuild
        if len(self._heap) > 2 * len(self._waiting) + 64:
            self._heap = [entry for entry in self._heap if entry[1].seq_id in self._waiting]
            heapq.heapify(self._heap)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        del self.keys[seq.seq_id]

    def _peek(self) -> Sequence | None:
        heap = self._heap
        while heap and heap[0][1].seq_id not in self._waiting:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    # --- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.long_prefill_token_threshold or budget
        budget = self.schedule_running(out, budget, sorted(self.running.values(), key=self.key), cap)
        while budget > 0:
            seq = self._peek()
            if seq is None or any(seq is p for p in out.preempted):
                break  # a request preempted in this step is readmitted in a later one
            n = self.allocate_chunk(seq, min(budget, cap)) if len(self.running) < self.max_num_seqs else 0
            if n:
                heapq.heappop(self._heap)
                del self._waiting[seq.seq_id]
                self.admit(seq)
                out.add(seq, n)
                budget -= n
                continue
            victim = self._victim_for(seq)
            if victim is None:
                break
            budget += self._unschedule(victim, out)
            self.preempt(victim)
            out.preempted.append(victim)
        return out

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """The least urgent running request that ``seq`` may preempt: a strictly larger priority value and key."""
        priority, key = seq.sampling_params.priority, self.key(seq)
        victims = [r for r in self.running.values() if r.sampling_params.priority > priority and self.key(r) > key]
        return max(victims, key=self.key, default=None)

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> int:
        """Take ``seq`` out of this step's output; returns the tokens it had there (0 if it was not in it)."""
        for i, scheduled in enumerate(out.seqs):
            if scheduled is seq:
                del out.seqs[i]
                return out.num_new_tokens.pop(i)
        return 0
