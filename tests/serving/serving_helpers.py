"""Shared by the serving tests: a real uvicorn server on 127.0.0.1 (a free port) around an engine, run in a
thread of the test process so that tests can read the engine's state directly; a chat job with a scripted reply."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn

from nanovllm_core.outputs import CompletionOutput
from nanovllm_core.serving.api_server import ServerSettings, build_app
from nanovllm_core.serving.async_llm import AsyncLLM
from nanovllm_core.serving.openai_serving import Job

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=512, max_num_seqs=64)
API_KEY = "test-key"
MODEL = "tiny-qwen3"


class ServerThread:
    """uvicorn serving ``app`` on a socket bound to a free port, in a background thread."""

    def __init__(self, app: Any, engine: AsyncLLM) -> None:
        self.engine = engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, backlog=2048)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's event loop (e.g. ``engine.stats()``) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.engine._loop).result(timeout)

    def stats(self) -> Any:
        return self.call(self.engine.stats())

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """The engine's stats once no request is left in it and every KV block is free (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if (idle and stats.num_free_kv_blocks == stats.num_kv_blocks) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)


def start_server(path: Any, settings: ServerSettings, **engine_overrides: Any) -> ServerThread:
    engine = AsyncLLM.from_config(str(path), **{**ENGINE, **engine_overrides})
    return ServerThread(build_app(engine, settings), engine).start()


class ScriptedJob(Job):
    """A chat job whose one choice's reply arrives in the given pieces, the last one finishing it (the reply
    parsers' tests: no engine behind it)."""

    def __init__(self, pieces: list[str], **parsers: Any) -> None:
        stream = SimpleNamespace(done=True, num_prompt_tokens=3, request_id="r")
        super().__init__(None, "chatcmpl-test", MODEL, [stream], 1, None, **parsers)  # type: ignore[arg-type]
        self.pieces = pieces

    async def _outputs(self) -> Any:
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            self.completion_tokens[0] += 1
            yield 0, CompletionOutput(0, piece, [i], "stop" if last else None)


def pieces_of(text: str, size: int) -> list[str]:
    """``text`` in pieces of ``size`` characters (one empty piece for an empty text)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def start_serve_process(
    args: list[str], port: int, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.Popen:
    """``nanovllm serve ARGS --port PORT`` in a subprocess (its output piped), returned once ``/health`` answers."""
    cmd = [sys.executable, "-m", "nanovllm_core.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)
