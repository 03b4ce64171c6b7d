"""``mixed``: vLLM-style decode-first chunked scheduling, so that one step mixes decode tokens and prompt chunks.

Each step:

1. Running requests first, in admission order: each gets one decode token, or the next chunk of a prompt it
   is still computing. When the KV cache has no block for one, the least urgent running request not served
   yet in this step is preempted (recompute preemption: its blocks are freed, it goes back to the head of the
   waiting queue and its KV is computed again once it is readmitted); with nothing else left, the request
   preempts itself. Least urgent is the latest admitted; when the running requests carry different
   ``SamplingParams.priority`` values, it is the largest value (lower is more urgent), then the latest
   admitted, and the step serves running requests in that order, most urgent first.
2. The rest of the token budget goes to waiting requests in arrival order (preempted ones first), one prompt
   chunk each, for as many as ``max_num_seqs``, the budget and the KV cache allow. A step that preempted
   admits nothing new: the cache is full.

``long_prefill_token_threshold`` (0: off) caps every chunk, so that one long prompt cannot take a whole step
and the prompts behind it (and their time to first token) are not held up by it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from nanovllm_core import BlockManager, EngineConfig, Scheduler, SchedulerOutput, Sequence


class MixedScheduler(Scheduler):
    class Options(BaseModel):
        """``[plugins] scheduler_options`` accepted by ``mixed``."""

        model_config = ConfigDict(extra="forbid")
        long_prefill_token_threshold: int = Field(
            0, ge=0, description="Most tokens one prompt chunk may take in a step; 0 leaves only the step's budget."
        )

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, long_prefill_token_threshold: int = 0
    ) -> None:
        super().__init__(config, block_manager)
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.long_prefill_token_threshold or budget
        budget = self.schedule_running(out, budget, self._running_most_urgent_first(), cap)
        if not out.preempted:  # a step that preempted admits nothing: the cache is full
            self.schedule_waiting(out, budget, cap)
        return out

    def _running_most_urgent_first(self) -> list[Sequence]:
        seqs = list(self.running.values())  # admission order
        if seqs:
            first = seqs[0].sampling_params.priority
            if any(seq.sampling_params.priority != first for seq in seqs):
                seqs.sort(key=lambda seq: seq.sampling_params.priority)  # stable: admission order within a level
        return seqs
