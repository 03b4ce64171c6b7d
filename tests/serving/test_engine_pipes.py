"""The pipes between the front-end's event loop and an engine process: a flood of commands while the engine floods
outputs back never deadlocks (both pipes full, each side blocked writing), and the commands' framing is what
``Connection.recv`` reads."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import pickle

from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.serving.async_llm import AsyncLLM
from nanovllm_core.serving.step_loop import EngineProcess, frame_message
from nanovllm_core.testing.scripted import build_scripted_engine


def test_framed_commands_read_back_with_connection_recv():
    reader, writer = multiprocessing.Pipe(duplex=False)
    commands = [(1, "add", (list(range(5000)), SamplingParams(max_tokens=3), "r1")), (None, "stop", ())]
    with writer:
        writer.send_bytes(b"")  # a message before, sent the usual way
        import os

        os.write(writer.fileno(), frame_message(pickle.dumps(commands)))
    assert reader.recv_bytes() == b""
    assert reader.recv() == commands


def test_a_flood_of_commands_against_a_flood_of_outputs_completes(tiny_path):
    """400 requests with 6,000-token prompts (megabytes of commands) sent at once to an engine that answers every
    step with an output per request: with blocking writes on the event loop both pipes filled and both sides
    waited on each other for ever."""
    build = functools.partial(build_scripted_engine, str(tiny_path), 0.0, 400)
    prompt = list(range(6000))
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def main() -> list[int]:
        async with AsyncLLM(EngineProcess(build=build)) as llm:

            async def one(i: int) -> int:
                return sum([len(out.outputs[0].token_ids) async for out in llm.generate(prompt, params, f"r{i}")])

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(400))), 120)

    assert asyncio.run(main()) == [20] * 400
