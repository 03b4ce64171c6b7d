"""The urgent lane (``urgent_lane_tokens``): a request that the scheduler picks as urgent (``priority`` with
``urgent_priority``) and that arrives while a step is in flight is prefilled at once, in a step of its own, and
decodes with the others from then on. Greedy tokens stay ``fifo``'s.

On CPU the lane's step runs in turn with the main ones (CUDA runs it on a second stream), but the bookkeeping is
the same: two launched steps unread at once, the lane's first token read before the next main step is scheduled,
aborts while the lane's step is unread, the lane refusing what does not fit it.
"""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, MAX_NEW, PROMPTS, make_prompts

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.errors import ConfigError, SchedulerError
from nanovllm_core.interfaces import SchedulerOutput

LANE_TOKENS = 64
URGENT = make_prompts(7, [9, 30, 64, 65])  # urgent prompts, by length
BY_LENGTH = {len(p): p for p in URGENT}


def lane_llm(path, urgent_priority: int | None = 0, **kwargs) -> LLM:
    options = {} if urgent_priority is None else {"urgent_priority": urgent_priority}
    kwargs = {"num_kvcache_blocks": 128, "urgent_lane_tokens": LANE_TOKENS, **kwargs}
    return LLM(
        str(path),
        kvcache_block_size=16,
        max_model_len=512,
        async_scheduling="on",
        plugins={"attention": "torch", "scheduler": "priority", "scheduler_options": options},
        **kwargs,
    )


def with_a_step_in_flight(llm: LLM, prompt: list[int] = PROMPTS[0]) -> LLM:
    """``llm`` with a low-priority request ("low") whose first step is launched and unread."""
    llm.add_request(prompt, GREEDY, "low", priority=1)
    llm.step()
    return llm


def run_to_end(llm: LLM) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


@pytest.fixture(scope="module")
def fifo_tokens(qwen3_path) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every prompt these tests run, under ``fifo``."""
    llm = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=128,
              plugins={"attention": "torch"})  # fmt: skip
    prompts = PROMPTS + URGENT
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}


def test_an_urgent_arrival_takes_the_lane_and_keeps_fifos_tokens(qwen3_path, fifo_tokens):
    llm = lane_llm(qwen3_path)
    assert llm.urgent_lane_tokens == LANE_TOKENS
    prompts = {f"low{i}": p for i, p in enumerate(PROMPTS)}
    for request_id, prompt in prompts.items():
        llm.add_request(prompt, GREEDY, request_id, priority=1)
    llm.step()
    llm.step()  # a step is in flight now
    urgent = URGENT[:2]
    for i, prompt in enumerate(urgent):
        prompts[f"urgent{i}"] = prompt
        llm.add_request(prompt, GREEDY, f"urgent{i}", priority=0)
    llm._launch_urgent()
    assert llm.stats().num_urgent_lane_steps == 1
    # both urgent prompts (39 tokens) fit the lane's 64: admitted together, their first token sampled there
    urgent_seqs = [s for s in llm.scheduler.running.values() if s.request_id.startswith("urgent")]
    assert [(s.num_computed_tokens, s.num_tokens) for s in urgent_seqs] == [(9, 10), (30, 31)]
    tokens = run_to_end(llm)  # the next step reads the lane's tokens before it schedules
    assert tokens == {rid: fifo_tokens[tuple(p)] for rid, p in prompts.items()}
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.stats().num_urgent_lane_steps == 1


def test_the_first_token_comes_from_the_lane(qwen3_path, fifo_tokens):
    """Streamed: the lane's output is the request's first token, before any main step ran it."""
    llm = lane_llm(qwen3_path)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(prompt, GREEDY, f"low{i}", priority=1)
    llm.step()
    prompt = BY_LENGTH[30]
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, output_kind="delta"),
                    "urgent", priority=0)  # fmt: skip
    llm._launch_urgent()
    (first,) = llm._poll_urgent()  # on CPU the lane's step is done at once
    assert first.request_id == "urgent" and first.outputs[0].token_ids == fifo_tokens[tuple(prompt)][:1]
    assert llm._poll_urgent() == []
    streamed = list(first.outputs[0].token_ids)
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == "urgent":
                streamed += out.outputs[0].token_ids
    assert streamed == fifo_tokens[tuple(prompt)]


@pytest.mark.parametrize(
    "lengths, priority, admitted",
    [
        ([64], 0, [64]),  # exactly the lane's tokens
        ([65], 0, []),  # one over: the main steps take it
        ([9], 1, []),  # not urgent
        ([9], -3, [9]),  # more urgent than urgent_priority
        ([30, 64], 0, [30]),  # the second no longer fits: it waits, and nothing after it goes first
    ],
    ids=["fits", "too-long", "not-urgent", "more-urgent", "first-fits"],
)
def test_what_the_lane_admits(qwen3_path, fifo_tokens, lengths, priority, admitted):
    llm = with_a_step_in_flight(lane_llm(qwen3_path), PROMPTS[1])
    by_length = BY_LENGTH
    for i, n in enumerate(lengths):
        llm.add_request(by_length[n], GREEDY, f"r{i}", priority=priority)
    llm._launch_urgent()
    running = {s.request_id: s.num_computed_tokens for s in llm.scheduler.running.values()}
    assert [running[f"r{i}"] for i in range(len(admitted))] == admitted
    assert llm.scheduler.num_waiting == len(lengths) - len(admitted)
    tokens = run_to_end(llm)
    assert tokens == {"low": fifo_tokens[tuple(PROMPTS[1])]} | {
        f"r{i}": fifo_tokens[tuple(by_length[n])] for i, n in enumerate(lengths)
    }


def test_the_lane_waits_for_a_step_in_flight(qwen3_path):
    """With nothing on the device the next main step admits the request as soon: the lane stays idle."""
    llm = lane_llm(qwen3_path)
    llm.add_request(BY_LENGTH[9], GREEDY, "urgent", priority=0)
    llm._launch_urgent()
    assert llm.stats().num_urgent_lane_steps == 0
    run_to_end(llm)


def test_abort_while_the_lanes_step_is_unread(qwen3_path, fifo_tokens):
    llm = with_a_step_in_flight(lane_llm(qwen3_path), PROMPTS[2])
    llm.add_request(BY_LENGTH[30], GREEDY, "urgent", priority=0)
    llm._launch_urgent()
    out = llm.abort_request("urgent")
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert llm._poll_urgent() == []
    assert run_to_end(llm) == {"low": fifo_tokens[tuple(PROMPTS[2])]}
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_off_without_a_scheduler_that_picks_urgent_requests(qwen3_path):
    llm = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=32,
              urgent_lane_tokens=LANE_TOKENS, plugins={"attention": "torch"})  # fmt: skip
    assert llm.urgent_lane_tokens == 0  # fifo has no schedule_urgent


def test_priority_without_urgent_priority_admits_nothing(qwen3_path):
    llm = with_a_step_in_flight(lane_llm(qwen3_path, urgent_priority=None))
    llm.add_request(PROMPTS[1], GREEDY, "urgent", priority=-100)
    llm._launch_urgent()
    assert llm.stats().num_urgent_lane_steps == 0
    run_to_end(llm)


def test_a_scheduler_that_breaks_the_lanes_rules_is_named(qwen3_path, monkeypatch):
    llm = with_a_step_in_flight(lane_llm(qwen3_path))
    llm.add_request(PROMPTS[3], GREEDY, "urgent", priority=0)
    scheduler = llm.scheduler

    def half_a_prompt(max_tokens: int) -> SchedulerOutput:
        out = SchedulerOutput()
        seq = scheduler._peek()
        n = scheduler.allocate_chunk(seq, 10)  # 10 of its 40 tokens: it would sample nothing
        scheduler.remove_waiting(seq)
        scheduler.admit(seq)
        out.add(seq, n)
        return out

    monkeypatch.setattr(scheduler, "schedule_urgent", half_a_prompt)
    with pytest.raises(SchedulerError, match=r"scheduler 'priority' gave the urgent lane 10 tokens"):
        llm._launch_urgent()


def test_not_with_tensor_parallelism(qwen3_path):
    with pytest.raises(ConfigError, match="urgent_lane_tokens .* needs tensor_parallel_size 1"):
        LLM(str(qwen3_path), urgent_lane_tokens=64, tensor_parallel_size=2)


@pytest.mark.parametrize("shares_a_prefix", [True, False], ids=["cached-prefix", "unrelated"])
def test_the_lane_waits_for_queued_steps_that_touch_its_blocks(qwen3_path, fifo_tokens, monkeypatch, shares_a_prefix):
    """A lane step that reads a cached prefix which a queued main step is still filling (or writes blocks one
    still uses) is ordered after the queued steps; others run beside them. CUDA's stream order is emulated here
    by a main step that says it is not done."""
    low = PROMPTS[2]  # 40 tokens: two full blocks of 16, indexed in the prefix cache when its step is launched
    llm = with_a_step_in_flight(lane_llm(qwen3_path), low)
    in_flight = llm._in_flight
    monkeypatch.setattr(in_flight, "done", lambda: False)
    decisions = []
    launch = llm.step_runner.launch_urgent

    def spy(batch, after_queued):
        decisions.append(after_queued)
        return launch(batch, after_queued)

    monkeypatch.setattr(llm.step_runner, "launch_urgent", spy)
    urgent = low[:32] + BY_LENGTH[9] if shares_a_prefix else BY_LENGTH[30]
    llm.add_request(urgent, GREEDY, "urgent", priority=0)
    llm._launch_urgent()
    assert decisions == [shares_a_prefix]
    monkeypatch.undo()
    tokens = run_to_end(llm)
    assert tokens["low"] == fifo_tokens[tuple(low)]
    if not shares_a_prefix:
        assert tokens["urgent"] == fifo_tokens[tuple(urgent)]
