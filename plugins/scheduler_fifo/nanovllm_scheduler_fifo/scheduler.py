"""``fifo``: prefill first, chunked prefill for the head of the queue, recompute preemption.

The policy of nano-vllm's scheduler, reimplemented: each step first admits waiting sequences in arrival
order while the token budget and the KV cache allow (only the first one of a step may be cut into a
chunk; it stays at the head of the queue until its last chunk); a step with no prefill work decodes one
token for every running sequence, and when the cache is full it preempts the most recently admitted
running sequence back to the head of the queue (its KV is recomputed later).
"""

from __future__ import annotations

from nanovllm_core import Scheduler, SchedulerOutput


class FifoScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        while self.waiting and len(out) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            remaining = seq.num_uncomputed_tokens if seq.block_table else seq.num_tokens - bm.num_cached_tokens(seq)
            if remaining > budget and out.seqs:
                break  # only the first prompt of a step is cut into a chunk
            num_new = self.allocate_chunk(seq, budget, whole_prompt=True)
            if not num_new:
                break
            if num_new == seq.num_uncomputed_tokens:
                self.admit(self.waiting.popleft())
            out.add(seq, num_new)
            budget -= num_new
        if not out.seqs:  # decode: every running sequence, the most recently admitted preempted first
            self.schedule_running(out, budget)
        return out
