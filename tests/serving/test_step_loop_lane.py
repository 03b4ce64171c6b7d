"""The step loop with the engine's urgent lane: while a step waits for the device, ``add`` commands are taken in
at once and the lane launched for them, its first tokens handed over as soon as they are read; any other command,
and everything after it, waits for the step's end, in order. Then the same end to end through AsyncLLM."""

from __future__ import annotations

import asyncio

from serving_helpers import ENGINE

from nanovllm_core import LLMEngine, SamplingParams
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.serving.async_llm import AsyncLLM
from nanovllm_core.serving.step_loop import run_step_loop


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [token])], finished)


class LaneEngine:
    """Records what the loop calls; its one step waits for the device through three ``idle`` calls."""

    urgent_lane_tokens = 64

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.requests: set[str] = set()
        self.urgent_ready: list[RequestOutput] = []
        self.stepped = False

    def add_request(self, prompt, params, request_id) -> None:
        self.calls.append(f"add {request_id}")
        self.requests.add(request_id)

    def abort_request(self, request_id):
        self.calls.append(f"abort {request_id}")
        self.requests.discard(request_id)
        return output(request_id, 0, finished=True)

    def stats(self):
        self.calls.append("stats")
        return "stats"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) and not self.stepped

    def _launch_urgent(self) -> None:
        self.calls.append("launch_urgent")
        if "add urgent" in self.calls and not any(o.request_id == "urgent" for o in self.urgent_ready):
            self.urgent_ready.append(output("urgent", 7))

    def _poll_urgent(self) -> list[RequestOutput]:
        ready, self.urgent_ready = self.urgent_ready, []
        return ready

    def step(self, idle=None):
        self.calls.append("step")
        for _ in range(3):
            idle()
        self.calls.append("step done")
        self.stepped = True
        return [output("first", 1)]


def test_adds_run_during_the_wait_and_the_rest_waits_for_the_step_in_order():
    engine = LaneEngine()
    script = [
        [(1, "add", ([1], None, "first"))],
        [(2, "add", ([2], None, "urgent"))],  # during the step's wait: added and launched at once
        [(3, "abort", ("first",)), (4, "add", ([3], None, "after"))],  # deferred, the add after it too
        [],
        [(5, "stop", ())],  # taken with the deferred ones after the step: it aborts what is left
    ]
    handed: list[tuple[list, list[str]]] = []

    def next_commands(block: bool, timeout: float = 0.0):
        return script.pop(0) if script else []

    def emit(results, outputs, now, account):
        handed.append(([r[0] for r in results], [o.request_id for o in outputs]))

    run_step_loop(engine, next_commands, emit)
    assert engine.calls[:8] == [
        "add first",
        "launch_urgent",
        "step",
        "add urgent",
        "launch_urgent",
        "step done",
        "abort first",
        "add after",
    ]
    assert sorted(engine.calls[8:]) == ["abort after", "abort urgent"]  # the stop's, in no particular order
    # the urgent request's first token goes out during the step, before the step's own outputs
    assert handed[:3] == [([1], []), ([2], ["urgent"]), ([], ["first"])]
    (results, outputs), *rest = handed[3:]
    assert results == [3, 4] and outputs[0] == "first" and sorted(outputs[1:]) == ["after", "urgent"] and not rest


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_async_llm_with_the_lane_gives_the_offline_tokens(tiny_path, greedy):
    engine = LLMEngine(str(tiny_path), **ENGINE, async_scheduling="on", urgent_lane_tokens=32,
                       plugins={"scheduler": "priority", "scheduler_options": {"urgent_priority": 0}})  # fmt: skip
    assert engine.urgent_lane_tokens == 32
    prompts = [[3 + i, 40 + i, 7, 9] * (i + 1) for i in range(8)]

    async def one(llm, prompt, i):
        await asyncio.sleep(0.01 * i)  # arrivals while steps run
        outs = [out async for out in llm.generate(prompt, GREEDY, request_id=f"r{i}", priority=i % 2)]
        return [t for o in outs for t in o.outputs[0].token_ids]

    async def main():
        async with AsyncLLM(engine) as llm:
            return await asyncio.wait_for(asyncio.gather(*(one(llm, p, i) for i, p in enumerate(prompts))), 120)

    got = asyncio.run(main())
    assert got == [greedy(p, 12)[1] for p in prompts]
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_urgent_lane_steps > 0
    engine.shutdown()
