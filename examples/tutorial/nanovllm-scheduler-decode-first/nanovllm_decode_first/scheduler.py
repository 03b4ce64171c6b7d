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
        # 2. Waiting requests, in arrival order, one prompt chunk each while seats, tokens and blocks last; none
        #    after a preemption (the cache is full).
        if not out.preempted:
            self.schedule_waiting(out, budget)
        return out
