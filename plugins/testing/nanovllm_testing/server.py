"""A real uvicorn server on 127.0.0.1 (a free port) around an engine, run in a thread of the test process so that a
test can read the engine's state directly (the serving tests, ``nanovllm-bench``'s ``bench serve`` tests). Needs the
``[serve]`` extra."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn

from nanovllm_core.serving.api_server import ServerSettings, build_app
from nanovllm_core.serving.async_llm import AsyncLLM

SERVER_ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=512, max_num_seqs=64)
"""The engine settings of :func:`start_server` (a tiny checkpoint on the CPU), before its overrides."""


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
    """The checkpoint at ``path`` served with ``settings`` (:data:`SERVER_ENGINE`, then ``engine_overrides``), started;
    ``stop()`` it when done."""
    engine = AsyncLLM.from_config(str(path), **{**SERVER_ENGINE, **engine_overrides})
    return ServerThread(build_app(engine, settings), engine).start()
