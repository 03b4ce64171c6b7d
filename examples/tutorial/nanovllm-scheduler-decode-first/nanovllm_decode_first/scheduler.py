"""``decode_first``: every step decodes the running requests first, then fills the token budget with
prompt chunks of waiting requests, so that one step mixes decode tokens and prompt chunks."""

from collections import deque

from nanovllm_core import InvalidRequestError, Scheduler, SchedulerOutput, Sequence
from nanovllm_core.sequence import SequenceStatus


class DecodeFirstScheduler(Scheduler):
    def __init__(self, config, block_manager, stop_checker):
        super().__init__(config, block_manager, stop_checker)
        self.waiting: deque[Sequence] = deque()  # hold no KV blocks, in arrival order
        self.running: dict[int, Sequence] = {}  # hold KV blocks, in admission order
        self.requests: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already queued")
        longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.config.max_model_len or 1 << 62)
        needed = self.block_manager.num_blocks_for(longest - 1)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id!r} may need {needed} KV-cache blocks but the cache has "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more blocks"
            )
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # 1. Running requests, oldest first: one decode token each, or the next chunk of their prompt.
        queue = deque(self.running.values())
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = queue.pop() if queue else seq  # the cache is full: preempt the newest request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
        # 2. Waiting requests, in arrival order, while seats, tokens and blocks last.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq, seq.num_uncomputed_tokens):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running[seq.seq_id] = seq
            n = min(seq.num_uncomputed_tokens, budget)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0  # its KV is gone: recompute it when it is admitted again
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        finished = []
        for seq, n, token_id in zip(batch.seqs, batch.num_new_tokens, sampled_token_ids):
            if self.advance(seq, n, token_id):
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
