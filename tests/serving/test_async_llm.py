"""AsyncLLM without HTTP: incremental outputs, abort (blocks back), shutdown, rejected requests, an idle loop that
sleeps, a failing step loop, and merging the deltas a slow consumer has not read yet."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from serving_helpers import ENGINE

from nanovllm_core import InvalidRequestError, SamplingParams
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream, merge_deltas

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_path) -> ModelEngineCore:
    return ModelEngineCore(create_engine_config(str(tiny_path), **ENGINE))


def run(engine: ModelEngineCore, body) -> object:
    """Run ``body(async_llm)`` in a fresh event loop with a fresh AsyncLLM around the shared engine."""

    async def main():
        async with AsyncLLM(engine) as llm:
            return await asyncio.wait_for(body(llm), 60)

    return asyncio.run(main())


def all_free(stats) -> bool:
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0


def test_generate_yields_deltas_that_add_up_to_offline(engine, greedy):
    async def body(llm):
        return [out async for out in llm.generate("Hello world!", GREEDY)]

    outs = run(engine, body)
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    text = "".join(o.outputs[0].text for o in outs)
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert (text, ids) == greedy("Hello world!", 10)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert all(o.prompt == "Hello world!" for o in outs)


def test_concurrent_requests(engine, greedy):
    prompts = ["The quick brown fox", [3, 4, 5, 6], "To be or not to be", [40, 41]]

    async def one(llm, prompt, i):
        outs = [out async for out in llm.generate(prompt, GREEDY, request_id=f"r{i}")]
        return "".join(o.outputs[0].text for o in outs), [t for o in outs for t in o.outputs[0].token_ids]

    async def body(llm):
        return await asyncio.gather(*(one(llm, p, i) for i, p in enumerate(prompts)))

    assert run(engine, body) == [greedy(p, 10) for p in prompts]


def test_vllm_prompt_dicts(engine, greedy):
    async def body(llm):
        outs = []
        for i, prompt in enumerate([{"prompt": "Hello world!"}, {"prompt_token_ids": [3, 4, 5, 6]}]):
            outs.append([out async for out in llm.generate(prompt, GREEDY, request_id=f"d{i}")])
        return outs

    by_text, by_ids = run(engine, body)
    assert ("".join(o.outputs[0].text for o in by_text), [t for o in by_text for t in o.outputs[0].token_ids]) == (
        greedy("Hello world!", 10)
    )
    assert by_text[-1].prompt == "Hello world!"
    assert [t for o in by_ids for t in o.outputs[0].token_ids] == greedy([3, 4, 5, 6], 10)[1]


def test_the_front_end_decodes_the_text_and_the_engine_sends_ids(engine, monkeypatch):
    """The engine sends token ids only, with stop strings or without (the front-end's output processor decodes and
    matches them); the pieces add up to each sample's whole decode (n=2, sampled, random byte-level ids: characters
    split across tokens)."""
    sent, engine_texts = [], []
    add, step = engine.add_request, engine.step
    monkeypatch.setattr(engine, "add_request", lambda ids, params, rid: (sent.append(params), add(ids, params, rid)))

    def recording_step():
        outputs = step()
        engine_texts.extend(c.text for out in outputs for c in out.outputs)
        return outputs

    monkeypatch.setattr(engine, "step", recording_step)
    prompt = [(37 * i) % 380 + 3 for i in range(30)]
    decode = engine.tokenizer.decode

    async def body(llm):
        results = []
        for params in (
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True, stop=["never-in-output"]),
        ):
            pieces = {0: ["", []], 1: ["", []]}
            async for out in llm.generate(prompt, params):
                for c in out.outputs:
                    pieces[c.index][0] += c.text
                    pieces[c.index][1] += c.token_ids
            results.append(pieces)
        return results

    front_end, in_engine = run(engine, body)
    assert [p.stop_strings for p in sent] == [[], ["never-in-output"]]
    assert engine_texts and not any(engine_texts)  # the engine decoded nothing
    for pieces in (front_end, in_engine):
        for text, ids in pieces.values():
            assert len(ids) == 40 and text == decode(ids, skip_special_tokens=True)
    assert front_end == in_engine  # same seed: same samples, same text


def test_abort_frees_blocks_and_ends_the_stream(engine):
    async def body(llm):
        stream = await llm.add_request("Hello", LONG, "long")
        first = await stream.__anext__()
        assert not first.finished
        await llm.abort("long")
        stats = await llm.stats()  # the abort ran before this snapshot
        rest = [out async for out in stream]
        return stats, rest

    stats, rest = run(engine, body)
    assert all_free(stats)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in rest) < 400


def test_a_stop_string_ends_the_stream_and_aborts_the_request_in_the_engine(engine, greedy):
    """The front-end matches the stop string, ends the stream with it and aborts the request in the engine, which
    would otherwise run on to max_tokens; the text and tokens are the offline ones up to the match."""
    text, ids = greedy("Hello", 60)
    stop = text[10:13]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop])

    async def body(llm):
        outs = [out async for out in llm.generate("Hello", params)]
        for _ in range(100):  # the abort was queued when the stream ended
            stats = await llm.stats()
            if all_free(stats):
                break
        return outs, stats

    outs, stats = run(engine, body)
    last = outs[-1].outputs[0]
    got_ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert "".join(o.outputs[0].text for o in outs) == text[: text.find(stop)]
    assert got_ids == ids[: len(got_ids)] and len(got_ids) < 60
    assert all_free(stats)  # well before max_tokens: the engine aborted it


def test_leaving_generate_early_aborts(engine):
    async def body(llm):
        async for _ in llm.generate("Hello", LONG):
            break
        for _ in range(100):
            stats = await llm.stats()
            if all_free(stats):
                return stats, llm.num_unfinished
            await asyncio.sleep(0.01)
        return stats, llm.num_unfinished

    stats, unfinished = run(engine, body)
    assert all_free(stats) and unfinished == 0
    assert stats.num_generation_tokens < 400 + engine.stats().num_generation_tokens  # not run to the end


def test_rejected_request_raises_and_leaves_nothing(engine):
    async def body(llm):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await llm.add_request([1, 10**7], GREEDY)
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await llm.add_request([1] * ENGINE["max_model_len"], GREEDY)
        stream = await llm.add_request("Hello", LONG, "dup")
        with pytest.raises(InvalidRequestError, match="already in use"):
            await llm.add_request("Hello", GREEDY, "dup")
        await llm.abort("dup")
        [out async for out in stream]
        return llm.num_unfinished, llm.num_queued, await llm.stats()

    unfinished, queued, stats = run(engine, body)
    assert unfinished == queued == 0 and all_free(stats)


def test_priority_argument_reaches_the_engine(engine, greedy, monkeypatch):
    seen = []
    add = engine.add_request

    def spy(prompt, params=None, request_id=None, *args, **kwargs):
        seen.append(params.priority)
        return add(prompt, params, request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)

    async def body(llm):
        outs = [out async for out in llm.generate("Hello world!", GREEDY, priority=7)]
        with pytest.raises(InvalidRequestError, match=r"priority=1.5 is invalid: allowed an integer"):
            await llm.add_request("Hello", GREEDY, priority=1.5)
        return outs, llm.num_unfinished

    outs, unfinished = run(engine, body)
    assert seen == [7] and unfinished == 0 and GREEDY.priority == 0
    text = "".join(o.outputs[0].text for o in outs)
    assert (text, [t for o in outs for t in o.outputs[0].token_ids]) == greedy("Hello world!", 10)


def test_shutdown_aborts_in_flight_and_stops_the_loop(engine):
    async def main():
        llm = AsyncLLM(engine)
        stream = await llm.add_request("Hello", LONG)
        await stream.__anext__()
        await llm.shutdown()
        rest = [out async for out in stream]
        assert rest[-1].outputs[0].finish_reason == "abort"
        assert not llm.core.alive and not llm.is_running
        with pytest.raises(EngineDeadError, match="shutting down"):
            await llm.add_request("Hello", GREEDY)

    asyncio.run(main())
    assert not engine.has_unfinished_requests() and all_free(engine.stats())


def test_shutdown_waits_for_in_flight_requests_up_to_the_timeout(engine):
    async def main():
        llm = AsyncLLM(engine)
        stream = await llm.add_request("Hello", GREEDY)
        await llm.shutdown(timeout=30)
        return [out async for out in stream]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 10


def test_idle_loop_sleeps(engine):
    async def body(llm):
        [out async for out in llm.generate("Hello", GREEDY)]
        await asyncio.sleep(0.5)  # let the engine's worker threads settle
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        return time.process_time() - cpu

    assert run(engine, body) < 0.15  # a spinning loop would burn about 0.5 s of CPU here


async def dead_after_generate(engine, error: str, request_id: str) -> AsyncLLM:
    """Start an AsyncLLM whose step loop fails: a request's generate raises EngineDeadError matching ``error``, and
    the loop is no longer running."""
    llm = AsyncLLM(engine)
    await llm.start()
    with pytest.raises(EngineDeadError, match=error):
        async for _ in llm.generate("Hello", GREEDY, request_id=request_id):
            pass
    assert not llm.is_running
    return llm


def test_failing_step_loop_fails_its_requests(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)

    async def main():
        llm = await dead_after_generate(engine, "device lost", "doomed")
        with pytest.raises(EngineDeadError, match="stopped"):
            await llm.add_request("Hello", GREEDY)

    asyncio.run(main())
    monkeypatch.undo()
    engine.abort_request("doomed")  # the dead loop left it in the engine
    assert all_free(engine.stats())


def test_a_step_loop_that_cannot_start_fails_its_requests(engine, monkeypatch):
    """The loop thread's set-up (binding the engine's CUDA device) failing is reported, not a silent dead thread
    behind a healthy-looking server (seen on the H200: ``torch.cuda.set_device("cuda")`` raised)."""
    import torch

    monkeypatch.setattr(engine, "device", torch.device("cuda"))

    def no_device(device):
        raise ValueError(f"cannot bind {device!r}")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    asyncio.run(asyncio.wait_for(dead_after_generate(engine, "cannot bind", "never"), 30))
    monkeypatch.undo()
    engine.abort_request("never")
    assert all_free(engine.stats())


def delta(index: int, text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids, finish)], finished=finish is not None)


@given(st.lists(st.tuples(st.integers(0, 1), st.text(max_size=3), st.lists(st.integers(0, 9), max_size=3)), max_size=8))
def test_unread_deltas_merge_into_one(pieces):
    async def main():
        stream = RequestStream("r", [1])
        for index, text, ids in pieces:
            stream.put(delta(index, text, ids))
        stream.put(delta(0, "!", [7], "stop"))
        return [out async for out in stream]

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished
    merged = {c.index: c for c in outs[0].outputs}
    for index in (0, 1):
        expected = [p for p in pieces if p[0] == index] + ([(0, "!", [7])] if index == 0 else [])
        if expected:
            assert merged[index].text == "".join(p[1] for p in expected)
            assert merged[index].token_ids == [t for p in expected for t in p[2]]
    assert merged[0].finish_reason == "stop"


def test_merge_keeps_logprobs_in_order():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [1], logprobs=[{1: 0.0}])], finished=False)
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "b", [2], "length", logprobs=[{2: -1.0}])], finished=True)
    merged = merge_deltas([a, b])
    assert merged.outputs[0].logprobs == [{1: 0.0}, {2: -1.0}] and merged.finished
    assert merged.outputs[0].text == "ab" and merged.outputs[0].finish_reason == "length"
