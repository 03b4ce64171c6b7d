"""The step loop in a process of its own (``engine_process=True`` / ``nanovllm serve --engine-process``): the same
outputs, aborts, stats and errors across the pipe; a server on it; a dead engine process fails its requests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from serving_helpers import ENGINE, ServerThread

from nanovllm_core import ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from nanovllm_core.engine_client.step_loop import EngineProcess
from nanovllm_core.serving.api_server import ServerSettings, build_app
from nanovllm_core.serving.async_llm import AsyncLLM, EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def process_server(tiny_path):
    engine = AsyncLLM.from_config(str(tiny_path), engine_process=True, **ENGINE)
    thread = ServerThread(build_app(engine, ServerSettings(served_model_name="p")), engine).start()
    yield thread
    thread.stop()
    assert not engine.core.alive and engine.core.process.exitcode == 0


def test_outputs_aborts_and_errors_across_the_pipe(process_server, greedy):
    llm = process_server.engine
    assert llm.engine is None and llm.config.max_model_len == ENGINE["max_model_len"]

    async def body():
        outs = [out async for out in llm.generate("Hello world!", GREEDY)]
        long = await llm.add_request("Hello", LONG, "long")
        await long.__anext__()
        await llm.abort("long")
        stats = await llm.stats()
        rest = [out async for out in long]
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await llm.add_request([1, 10**7], GREEDY)
        return outs, stats, rest

    outs, stats, rest = process_server.call(body())
    assert "".join(o.outputs[0].text for o in outs) == greedy("Hello world!", 10)[0]
    assert outs[-1].prompt == "Hello world!" and outs[-1].prompt_token_ids == llm.tokenize("Hello world!")
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert llm.account.steps > 0 and llm.account.step_seconds > 0


def test_a_stop_string_across_the_pipe_aborts_in_the_engine_and_reports_its_stages(process_server, greedy, monkeypatch):
    """The front-end matches the stop string on the token ids the engine process sends, aborts the request there, and
    reports its stages with the engine metrics that come back with the abort."""
    llm = process_server.engine
    text = greedy("Hello", 60)[0]
    at = next(i for i in range(2, 50) if "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    timelines = []
    monkeypatch.setattr(llm.observer, "timeline", timelines.append)

    async def body():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop])
        outs = [out async for out in llm.generate("Hello", params)]
        return outs, await llm.stats()  # sent after the abort: the engine has let the request go

    outs, stats = process_server.call(body())
    assert "".join(o.outputs[0].text for o in outs) == text[:at]
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", stop)
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert len(timelines) == 1 and timelines[0].first_token is not None
    assert timelines[0].handed <= timelines[0].engine_arrival <= timelines[0].first_token <= timelines[0].finished


def test_a_stop_string_ended_request_pulled_from_an_engine_process_keeps_its_metrics(tiny_path, offline, greedy):
    """``LLM``'s pull path over an engine process: streamed outputs cross without metrics, the front-end ends the
    request on its stop string, and its output carries the engine's metrics up to the match, as in this process."""
    text = greedy("Hello", 60)[0]
    at = next(i for i in range(2, 50) if "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[text[at : at + 3]])
    client = EngineProcess(EngineConfig.load(None, {"model": str(tiny_path), **ENGINE}))
    try:
        client.add_request("Hello", params, "s")
        outs = []
        while client.has_unfinished_requests():
            outs += client.step()
        stats = client.stats()
    finally:
        client.shutdown()
    want = offline.generate(["Hello"], params, use_tqdm=False)[0]
    assert len(outs) == 1 and outs[0].outputs[0].text == want.outputs[0].text == text[:at]
    for out in (outs[0], want):
        m, c = out.metrics, out.outputs[0]
        assert c.finish_reason == "stop" and m is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
        assert m.num_generation_tokens == len(c.token_ids) == len(want.outputs[0].token_ids)
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_http_on_an_engine_process(process_server, greedy):
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = httpx.post(process_server.url + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == greedy("The quick brown fox", 8)[0]
    with httpx.stream(
        "POST", process_server.url + "/v1/completions", json={**body, "max_tokens": 400, "stream": True}
    ) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    stats = process_server.wait_idle()  # the disconnect aborted it in the engine process
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_generation_tokens < 400 + 18


def test_shutdown_before_start_ends_the_engine_process(tiny_path):
    llm = AsyncLLM.from_config(str(tiny_path), engine_process=True, **ENGINE)
    asyncio.run(llm.shutdown())
    assert not llm.core.alive and llm.core.process.exitcode == 0 and not llm.is_running


def test_bad_config_fails_at_construction(tiny_path):
    with pytest.raises(ConfigError, match="max_num_seqs"):
        AsyncLLM.from_config(str(tiny_path), engine_process=True, **{**ENGINE, "max_num_seqs": 0})


def test_a_dead_engine_process_fails_its_requests(tiny_path):
    async def main():
        llm = AsyncLLM.from_config(str(tiny_path), engine_process=True, **ENGINE)
        stream = await llm.add_request("Hello", LONG)
        await stream.__anext__()
        llm.core.process.kill()
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in stream:
                pass
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.add_request("Hello", GREEDY)
        await llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


EXIT_SCRIPT = """
import asyncio, sys
from nanovllm_core import SamplingParams
from nanovllm_core.serving import AsyncLLM

async def main():
    llm = AsyncLLM.from_config(sys.argv[1], engine_process=True, device="cpu", max_model_len=512)
    stream = await llm.add_request("Hello", SamplingParams(max_tokens=400, ignore_eos=True))
    await stream.__anext__()
    print(llm.core.process.pid, flush=True)  # leaves with a request in flight and no shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_interpreter_exit_without_shutdown_ends_the_engine_process(tiny_path, tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # gone, not left behind


def test_outputs_survive_the_pipe_encoding():
    import pickle

    from nanovllm_core.engine_client.step_loop import pack_outputs, unpack_outputs
    from nanovllm_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

    lp = [{5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.5, 2, "b")}]
    outs = [
        RequestOutput(
            "a",
            "text",
            [1, 2],
            [CompletionOutput(0, "x", [5], "stop", 5, -0.1, lp)],
            True,
            1,
            None,
            RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0, 2, 1, 1),
            [None, {2: Logprob(-1.0, 1, "y")}],
        ),
        RequestOutput("b", None, [3], [CompletionOutput(1, "", [], None)], False),
    ]
    back = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(outs))))
    for before, after in zip(outs, back):
        assert after.prompt_token_ids == []  # left behind: the front-end has them
        after.prompt_token_ids = before.prompt_token_ids
        assert after == before
