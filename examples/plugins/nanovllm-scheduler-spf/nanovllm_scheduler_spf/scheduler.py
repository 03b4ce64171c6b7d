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

from nanovllm_core import BlockManager, EngineConfig, InvalidRequestError, Scheduler, SchedulerOutput, Sequence
from nanovllm_core.interfaces import StopChecker
from nanovllm_core.sequence import SequenceStatus


class ShortestPromptFirstScheduler(Scheduler):
    class Options(BaseModel):
        """``[plugins] scheduler_options`` accepted by this scheduler."""

        model_config = ConfigDict(extra="forbid")
        aging: float = Field(1.0, ge=0, description="Tokens of priority a waiting request gains per step.")

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, stop_checker: StopChecker, aging: float = 1.0
    ) -> None:
        super().__init__(config, block_manager, stop_checker)
        self.aging = aging
        self.max_model_len = config.max_model_len or 1 << 62
        self.steps = 0
        self.waiting: list[tuple[float, int, Sequence]] = []  # heap of (key, seq_id, seq)
        self.preempted: deque[Sequence] = deque()  # hold no blocks; recomputed before new requests
        self.chunked: Sequence | None = None  # the prompt cut into chunks, continued first
        self.running: dict[int, Sequence] = {}  # every request that holds blocks, in admission order
        self.requests: dict[str, Sequence] = {}

    # --- requests -------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already queued")
        longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)
        needed = self.block_manager.num_blocks_for(max(longest - 1, seq.num_tokens))
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id!r} may need {needed} KV-cache blocks but the cache has "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more blocks"
            )
        key = seq.num_prompt_tokens + self.aging * self.steps
        heapq.heappush(self.waiting, (key, seq.seq_id, seq))
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self) -> int:
        return len(self.requests)

    # --- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        out = self._prefill()
        return out if out.seqs else self._decode()

    def _prefill(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.chunked is not None:
            seq = self.chunked
            n = min(seq.num_uncomputed_tokens, budget)
            self._add_to(out, seq, n)
            budget -= n
            if seq.num_computed_tokens + n == seq.num_tokens:
                self.chunked = None
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek()
            if seq is None:
                break
            remaining = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if remaining > budget and out.seqs:
                break  # only the first prompt of a step is cut into a chunk
            if not self.block_manager.allocate(seq, seq.num_uncomputed_tokens):
                break  # no room in the KV cache: wait until running requests free blocks
            self._pop(seq)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.seq_id] = seq
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens:
                self.chunked = seq
            self._add_to(out, seq, n)
            budget -= n
        return out

    def _decode(self) -> SchedulerOutput:
        out = SchedulerOutput()
        queue = deque(self.running.values())
        while queue and len(out.seqs) < self.config.max_num_batched_tokens:
            seq = queue.popleft()
            while not self.block_manager.allocate(seq, 1):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_to(out, seq, 1)
        return out

    @staticmethod
    def _add_to(out: SchedulerOutput, seq: Sequence, num_new_tokens: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new_tokens)

    def _peek(self) -> Sequence | None:
        if self.preempted:
            return self.preempted[0]
        return self.waiting[0][2] if self.waiting else None

    def _pop(self, seq: Sequence) -> None:
        if self.preempted and self.preempted[0] is seq:
            self.preempted.popleft()
        else:
            heapq.heappop(self.waiting)

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.preempted.append(seq)

    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        finished = []
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, sampled_token_ids):
            if self.advance(seq, num_new, token_id):
                del self.running[seq.seq_id]
                del self.requests[seq.request_id]
                finished.append(seq)
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if self.running.pop(seq.seq_id, None) is None:
            if seq in self.preempted:
                self.preempted.remove(seq)
            else:
                self.waiting = [entry for entry in self.waiting if entry[2] is not seq]
                heapq.heapify(self.waiting)
        if self.chunked is seq:
            self.chunked = None
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq
