"""``decode_first``: every step decodes the running requests first, then fills the token budget with
prompt chunks of waiting requests, so that one step mixes decode tokens and prompt chunks."""

from nanovllm_core import Scheduler, SchedulerOutput


class DecodeFirstScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. Running requests, oldest first: one decode token each, or the next chunk of their prompt; when the
        #    cache is full the newest ones are preempted.
        budget = self.schedule_running(out, budget)
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
