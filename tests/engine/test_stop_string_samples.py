"""A stop string ends only its own sample of an n>1 request: the engine core aborts that sample as soon as the
front-end matches the string (its blocks back at once) and runs the request's other samples on, through every engine
client (in-process, ``AsyncLLM``, an engine process pulled or served); the outputs are the samples' own, cut at the
match."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import pytest

from nanovllm_core import LLM, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine_client.factory import make_engine_client
from nanovllm_core.serving.async_llm import AsyncLLM

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, max_num_seqs=16)
PROMPT = [(37 * i) % 380 + 3 for i in range(30)]
MAX_TOKENS = 300
FREE = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Case:
    params: SamplingParams  # FREE with a stop string that sample 0 meets early and sample 1 never
    want: list[tuple[str, list[int], str, str | None]]  # each sample's (text, token ids, finish and stop reasons)


@pytest.fixture(scope="module")
def llm(qwen3_path) -> LLM:
    return LLM(str(qwen3_path), **ENGINE)


@pytest.fixture(scope="module")
def case(llm) -> Case:
    free = llm.generate([PROMPT], FREE, use_tqdm=False)[0].outputs
    text0, text1 = free[0].text, free[1].text
    at = next(
        i for i in range(3, 40)
        if "\ufffd" not in text0[i : i + 3] and text0.find(text0[i : i + 3]) == i and text0[i : i + 3] not in text1
    )  # fmt: skip
    stop = text0[at : at + 3]
    decode = llm.get_tokenizer().decode
    ids0 = list(free[0].token_ids)
    end = next(k for k in range(1, len(ids0) + 1) if stop in decode(ids0[:k], skip_special_tokens=True))
    assert end < MAX_TOKENS // 4  # early: the engine would run sample 0 on for many more tokens
    want = [(text0[:at], ids0[:end], "stop", stop), (text1, list(free[1].token_ids), "length", None)]
    return Case(dataclasses.replace(FREE, stop=[stop]), want)


def seen(outputs) -> list[tuple[str, list[int], str, str | None]]:
    return [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in outputs]


def joined(deltas) -> list[tuple[str, list[int], str | None, str | None]]:
    """Each sample's delta outputs, added up."""
    samples: dict[int, list] = {0: ["", [], None, None], 1: ["", [], None, None]}
    for out in deltas:
        for c in out.outputs:
            sample = samples[c.index]
            sample[0] += c.text
            sample[1] += c.token_ids
            if c.finish_reason is not None:
                sample[2], sample[3] = c.finish_reason, c.stop_reason
    return [tuple(samples[i]) for i in (0, 1)]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_the_core_stops_stepping_the_stopped_sample_at_once(qwen3_path, case, async_scheduling):
    """Right after the step whose output matched, the core runs sample 1 alone and holds only its blocks; sample 0
    gets no token more (with async scheduling its token in flight is dropped)."""
    engine = LLMEngine(str(qwen3_path), async_scheduling=async_scheduling, **ENGINE)
    engine.add_request("r", PROMPT, dataclasses.replace(case.params, output_kind="delta"))
    deltas, at_match = [], None
    while engine.has_unfinished_requests():
        used_before = engine.stats().num_kv_blocks - engine.stats().num_free_kv_blocks
        outs = engine.step()
        deltas += outs
        if at_match is None and any(c.index == 0 and c.finish_reason for o in outs for c in o.outputs):
            at_match = engine.stats()
            num_tokens1 = len(joined(deltas)[1][1])
            used = at_match.num_kv_blocks - at_match.num_free_kv_blocks
            assert at_match.num_running == 1  # sample 1 only
            assert used < used_before  # sample 0's blocks went back
            assert used <= engine.block_manager.num_blocks_for(len(PROMPT) + num_tokens1 + 1)  # sample 1's alone
    assert at_match is not None
    assert joined(deltas) == case.want
    num_tokens0 = len(case.want[0][1])
    assert engine.stats().num_generation_tokens == num_tokens0 + MAX_TOKENS  # not 2 * MAX_TOKENS
    assert deltas[-1].metrics.num_generation_tokens == num_tokens0 + MAX_TOKENS
    engine.shutdown()


def test_llm_generate_gives_each_sample_its_own_output(llm, case):
    before = llm.llm_engine.stats().num_generation_tokens
    out = llm.generate([PROMPT], case.params, use_tqdm=False)[0]
    assert seen(out.outputs) == case.want
    assert llm.llm_engine.stats().num_generation_tokens - before == len(case.want[0][1]) + MAX_TOKENS


def assert_sample_0_cut_short(generated: int) -> None:
    """The engine produced sample 1 whole and sample 0 only until its abort reached it, well before max_tokens."""
    assert MAX_TOKENS <= generated < 2 * MAX_TOKENS - MAX_TOKENS // 2


@pytest.mark.parametrize("where", ["in_process", "engine_process"])
def test_async_llm(qwen3_path, case, where):
    async def main():
        if where == "in_process":
            llm = AsyncLLM(ModelEngineCore(create_engine_config(str(qwen3_path), **ENGINE)))
        else:
            llm = AsyncLLM.from_config(str(qwen3_path), engine_process=True, **ENGINE)
        async with llm:
            deltas = [out async for out in llm.generate(PROMPT, case.params, "r")]
            return deltas, await llm.stats()

    deltas, stats = asyncio.run(main())
    assert joined(deltas) == case.want and deltas[-1].finished
    assert_sample_0_cut_short(stats.num_generation_tokens)
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("where", ["engine_process", "data_parallel"])
def test_pulled_from_engines_in_processes_of_their_own(qwen3_path, case, where):
    """``LLM``'s pull path (the aborts go as commands to the engine's process, or to the replica that owns the
    request)."""
    replicas = 2 if where == "data_parallel" else 1
    config = EngineConfig.load(None, {"model": str(qwen3_path), "data_parallel_size": replicas, **ENGINE})
    client = make_engine_client(config, engine_process=True)
    try:
        client.add_request(PROMPT, case.params, "r")
        outs = [out for _ in iter(client.has_unfinished_requests, False) for out in client.step()]
        stats = client.stats()
    finally:
        client.shutdown()
    assert len(outs) == 1 and seen(outs[0].outputs) == case.want
    assert_sample_0_cut_short(stats.num_generation_tokens)
    assert_sample_0_cut_short(outs[0].metrics.num_generation_tokens)
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_aborting_samples_in_the_core_leaves_the_others_running(qwen3_path):
    """``abort_request(request_id, samples)``: those samples end as aborted with what they had (the request's output
    holds them, unfinished), the others run to their end; bad indices are refused, naming the allowed ones."""
    engine = ModelEngineCore(create_engine_config(str(qwen3_path), **ENGINE))  # the core's own outputs: token ids
    engine.add_request(PROMPT, dataclasses.replace(FREE, n=3, max_tokens=20, output_kind="delta"), "r")
    outs = []
    for _ in range(4):
        outs += engine.step()
    for bad in ([3], [1, 1]):
        with pytest.raises(InvalidRequestError, match=r"of request 'r': give distinct indices from 0 to 2"):
            engine.abort_request("r", bad)
    out = engine.abort_request("r", [1])
    assert not out.finished and [(c.index, c.finish_reason) for c in out.outputs] == [(1, "abort")]
    assert engine.stats().num_running == 2
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["length", "abort", "length"]
    num_tokens1 = sum(len(c.token_ids) for o in outs for c in o.outputs if c.index == 1)
    assert 0 < num_tokens1 < 4 and engine.stats().num_generation_tokens == 20 + num_tokens1 + 20
    assert engine.abort_request("r", [0]) is None  # finished: unknown
    engine.shutdown()
