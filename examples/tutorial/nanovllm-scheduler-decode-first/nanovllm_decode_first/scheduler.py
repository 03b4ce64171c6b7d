"""``decode_first``: every step decodes the running requests first, then fills the token budget with
prompt chunks of waiting requests, so that one step mixes decode tokens and prompt chunks."""

from collections import deque

from nanovllm_core import Scheduler, SchedulerOutput


class DecodeFirstScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. Running requests, oldest first: one decode token each, or the next chunk of their prompt.
        queue = deque(self.running.values())  # the newest last: preempted first when the cache is full
        while queue and budget > 0:
            seq = queue.popleft()
            if n := self.allocate_or_preempt(seq, budget, queue, out):
                out.add(seq, n)
                budget -= n
        # 2. Waiting requests, in arrival order, while seats, tokens and blocks last.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self.allocate_chunk(self.waiting[0], budget)
            if not n:
                break
            seq = self.waiting.popleft()
            self.admit(seq)
            out.add(seq, n)
            budget -= n
        return out
