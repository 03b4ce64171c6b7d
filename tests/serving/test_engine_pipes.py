"""The pipes between the front-end's event loop and an engine process: a flood of commands while the engine floods
outputs back never deadlocks (both pipes full, each side blocked writing), and the commands' framing is what
``Connection.recv`` reads."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import pickle
import threading

import pytest
from nanovllm_testing.scripted import build_scripted_engine

from nanovllm_core.engine_client.step_loop import EngineProcess, FrameReader, frame_message
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.serving.async_llm import AsyncLLM


def test_framed_commands_read_back_with_connection_recv():
    reader, writer = multiprocessing.Pipe(duplex=False)
    commands = [(1, "add", (list(range(5000)), SamplingParams(max_tokens=3), "r1")), (None, "stop", ())]
    with writer:
        writer.send_bytes(b"")  # a message before, sent the usual way
        os.write(writer.fileno(), frame_message(pickle.dumps(commands)))
    assert reader.recv_bytes() == b""
    assert reader.recv() == commands


def flood(tiny_path, run=asyncio.run) -> list[int]:
    """400 requests with 6,000-token prompts (megabytes of commands) sent at once to an engine that answers every
    step with an output per request."""
    build = functools.partial(build_scripted_engine, str(tiny_path), 0.0, 400)
    prompt = list(range(6000))
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def main() -> list[int]:
        async with AsyncLLM(EngineProcess(build=build)) as llm:

            async def one(i: int) -> int:
                return sum([len(out.outputs[0].token_ids) async for out in llm.generate(prompt, params, f"r{i}")])

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(400))), 120)

    return run(main())


def test_a_flood_of_commands_against_a_flood_of_outputs_completes(tiny_path):
    """With blocking writes on the event loop both pipes filled and both sides waited on each other for ever."""
    assert flood(tiny_path) == [20] * 400


def test_the_flood_under_uvloop(tiny_path):
    """uvicorn runs on uvloop when it is installed; uvloop makes the watched pipe non-blocking (Connection.recv
    then failed on a half-written message: "the engine process exited (status None)")."""
    uvloop = pytest.importorskip("uvloop")  # not a dependency; uvicorn uses it when a user installed it
    assert flood(tiny_path, uvloop.run) == [20] * 400


def test_frame_reader_cuts_what_connection_send_wrote_however_it_arrives():
    """The event loop reads the outputs pipe without blocking (uvloop makes a watched fd non-blocking, where
    Connection.recv fails on a half-written message): whatever the bytes' split, the messages come out whole."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    messages = [("out", [], [[i] * i], 0.5, None) for i in range(40)] + [("big", bytes(300_000)), ("closed",)]
    sender = threading.Thread(target=lambda: [writer.send(m) for m in messages])
    sender.start()
    stream = bytearray()
    while len(stream) < 300_000 or reader.poll(0.2):
        stream += os.read(reader.fileno(), 1 << 20)
    sender.join()
    for piece in (1, 7, 4096, len(stream)):
        frames, got = FrameReader(), []
        for at in range(0, len(stream), piece):
            got += frames.feed(bytes(stream[at : at + piece]))
        assert got == messages, piece


def test_loop_account_counts_slow_steps_and_combines_replicas():
    from nanovllm_core.engine_client.base import SLOW_STEP_SECONDS, LoopAccount

    a, b = LoopAccount(), LoopAccount()
    for seconds in (0.01, 0.06, 0.3):
        a.count_step(seconds)
    b.count_step(1.5)
    assert SLOW_STEP_SECONDS == (0.05, 0.2, 1.0)
    assert (a.steps, a.slow_steps, a.longest_step_seconds) == (3, [2, 1, 0], 0.3)
    both = LoopAccount.combined([a, b])
    assert (both.steps, both.slow_steps, both.longest_step_seconds) == (4, [3, 2, 1], 1.5)
    assert both.step_seconds == pytest.approx(1.87)
