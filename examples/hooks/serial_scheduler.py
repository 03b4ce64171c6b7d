"""``serial``: one request at a time, in arrival order. The smallest complete nanovllm scheduler.

The request at the head of the queue computes its prompt in chunks of at most the token budget, then decodes
one token per step until it finishes; then the next one starts. Only one request holds KV blocks at a time and
the engine rejects a request that could not fit the cache alone, so the cache never runs out: no preemption.
"""

from nanovllm_core import Scheduler, SchedulerOutput, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class SerialScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running and self.waiting:
            self.admit(self.waiting.popleft())
        for seq in self.running.values():  # at most one
            n = self.allocate_chunk(seq, self.max_num_batched_tokens)
            if not n:
                raise RuntimeError(f"no KV blocks for {seq!r} although it is the only request holding blocks")
            out.add(seq, n)
        return out


@hookimpl
def nanovllm_register_schedulers(register):
    register("serial", SerialScheduler)
