"""ScriptedEngine: what the serving step loop needs of an engine, with steps of a fixed duration and one token
per running request (token ids only, as the engine core returns them: the front-end makes the text), and no
model. It measures the serving front-end without a GPU (``benchmarks/frontend_capacity.py``) and drives it in
tests at rates no CPU model reaches."""

from __future__ import annotations

import time

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineStats
from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm_core.sampling_params import SamplingParams

__all__ = ["ScriptedEngine", "build_scripted_engine"]


class ScriptedEngine:
    """The step loop's view of an engine, with steps of a fixed duration and one token per running request (the
    ones that joined a step too)."""

    def __init__(self, model: str, step_s: float, max_num_seqs: int) -> None:
        self.config = EngineConfig(model=model, max_model_len=4096, max_num_seqs=max_num_seqs)
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.waiting: list[str] = []
        self.running: dict[str, list] = {}  # request id -> [tokens left, generated, metrics]
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.arrivals: dict[str, float] = {}  # request id -> when it reached the engine
        self.generated = 0

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.requests[request_id] = (token_ids, params)
        self.arrivals[request_id] = time.monotonic()
        self.waiting.append(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.requests:
            return None
        token_ids, _ = self.requests.pop(request_id)
        self.running.pop(request_id, None)
        self.arrivals.pop(request_id, None)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        return RequestOutput(request_id, None, token_ids, [CompletionOutput(0, "", [], "abort")], True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), 1, 1, 0, 0, 0, 0, self.generated, 0)

    def step(self) -> list[RequestOutput]:
        """As a GPU step without async scheduling: the batch is fixed as the step starts (the waiting requests that
        fit join it), the step takes ``step_s``, then every request in it gets a token."""
        now = time.monotonic()
        end = now + self.step_s
        while self.waiting and len(self.running) < self.max_num_seqs:
            request_id = self.waiting.pop(0)
            token_ids, params = self.requests[request_id]
            arrival = self.arrivals.pop(request_id)
            self.running[request_id] = [
                params.max_tokens,
                0,
                RequestMetrics(arrival, now, num_prompt_tokens=len(token_ids), prompt_scheduled_time=now),
            ]
        outputs = []
        time.sleep(max(0.0, end - time.monotonic()))
        now = time.monotonic()
        for request_id, state in list(self.running.items()):
            state[0] -= 1
            state[1] += 1
            metrics: RequestMetrics = state[2]
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generation_tokens = state[1]
            token = state[1] % 1000
            finish = "length" if state[0] == 0 else None
            outputs.append(
                RequestOutput(
                    request_id,
                    None,
                    self.requests[request_id][0],
                    [
                        CompletionOutput(0, "", [token], finish)
                    ],
                    finish is not None,
                    metrics=metrics,
                )
            )
            if finish:
                metrics.finished_time = now
                del self.running[request_id]
                del self.requests[request_id]
        self.generated += len(outputs)
        return outputs

    def shutdown(self) -> None:
        pass


def build_scripted_engine(model: str, step_s: float, max_num_seqs: int) -> ScriptedEngine:
    return ScriptedEngine(model, step_s, max_num_seqs)
