"""``serial``: one request at a time, in arrival order. The smallest complete nanovllm scheduler.

The request at the head of the queue computes its prompt in chunks of at most the token budget, then decodes
one token per step until it finishes; then the next one starts. Only one request holds KV blocks at a time and
``add`` rejects a request that could not fit the cache alone, so the cache never runs out: no preemption.
"""

from collections import deque

from nanovllm_core import InvalidRequestError, Scheduler, SchedulerOutput, Sequence, hookimpl
from nanovllm_core.sequence import SequenceStatus

NANOVLLM_PLUGIN_API = ">=2,<3"


class SerialScheduler(Scheduler):
    def __init__(self, config, block_manager, stop_checker):
        super().__init__(config, block_manager, stop_checker)
        self.queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.config.max_model_len or 1 << 62)
        if self.block_manager.num_blocks_for(longest - 1) > self.block_manager.num_blocks:
            raise InvalidRequestError(f"request {seq.request_id!r} does not fit the KV cache; lower max_tokens")
        if any(s.request_id == seq.request_id for s in self.queue):
            raise InvalidRequestError(f"request id {seq.request_id!r} is already queued")
        self.queue.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def num_unfinished(self) -> int:
        return len(self.queue)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.queue:
            return out
        seq = self.queue[0]
        # Blocks for every uncomputed token; for a new request this first claims its cached prefix.
        if not self.block_manager.allocate(seq, seq.num_uncomputed_tokens):
            raise RuntimeError(f"no KV blocks for {seq!r} although it is the only request holding blocks")
        seq.status = SequenceStatus.RUNNING
        out.seqs.append(seq)
        out.num_new_tokens.append(min(seq.num_uncomputed_tokens, self.config.max_num_batched_tokens))
        return out

    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        finished = []
        for seq, n, token_id in zip(batch.seqs, batch.num_new_tokens, sampled_token_ids):
            if self.advance(seq, n, token_id):
                self.queue.remove(seq)
                finished.append(seq)
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        seq = next((s for s in self.queue if s.request_id == request_id), None)
        if seq is not None:
            self.queue.remove(seq)
            self.block_manager.free(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return seq


@hookimpl
def nanovllm_register_schedulers(register):
    register("serial", SerialScheduler)
