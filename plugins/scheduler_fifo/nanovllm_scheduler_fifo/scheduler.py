"""``fifo``: prefill first, chunked prefill for the head of the queue, recompute preemption.

The policy of nano-vllm's scheduler, reimplemented: each step first admits waiting sequences in arrival
order while the token budget and the KV cache allow (only the first one of a step may be cut into a
chunk); a step with no prefill work decodes one token for every running sequence, and when the cache
is full it preempts the most recently admitted running sequence back to the head of the queue (its KV
is recomputed later).
"""

from __future__ import annotations

from collections import deque

from nanovllm_core import BlockManager, EngineConfig, InvalidRequestError, Scheduler, SchedulerOutput, Sequence
from nanovllm_core.interfaces import StopChecker
from nanovllm_core.sequence import SequenceStatus


class FifoScheduler(Scheduler):
    def __init__(self, config: EngineConfig, block_manager: BlockManager, stop_checker: StopChecker) -> None:
        super().__init__(config, block_manager, stop_checker)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len or 1 << 62
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> seq, in admission order
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        # The last sampled token never needs KV, hence the -1.
        longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len) - 1
        needed = self.block_manager.num_blocks_for(max(longest, seq.num_tokens))
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id!r} needs up to {needed} KV-cache blocks "
                f"({seq.num_prompt_tokens} prompt + {seq.sampling_params.max_tokens} max_tokens) but the cache holds "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more blocks"
            )
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already queued")
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        while self.waiting and len(out.seqs) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.block_table:  # a prompt cut into chunks by an earlier step
                remaining = seq.num_uncomputed_tokens
            else:
                remaining = seq.num_tokens - bm.num_cached_tokens(seq)
            if remaining > budget and out.seqs:
                break
            if not seq.block_table and not bm.allocate(seq, seq.num_uncomputed_tokens):
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running[seq.seq_id] = seq
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        if out.seqs:
            return out

        candidates = deque(self.running.values())
        while candidates and len(out.seqs) < self.max_num_seqs and budget > 0:
            seq = candidates.popleft()
            while not bm.allocate(seq, 1):
                if candidates:
                    victim = candidates.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                else:
                    self._preempt(seq)
                    out.preempted.append(seq)
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(1)
                budget -= 1
        return out

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq
