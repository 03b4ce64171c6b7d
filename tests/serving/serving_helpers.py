"""Shared by the serving tests: a real uvicorn server on 127.0.0.1 (a free port) around an engine, run in a
thread of the test process so that tests can read the engine's state directly (:mod:`nanovllm_testing.server`);
a chat job with a scripted reply; ``nanovllm serve`` in a subprocess."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import httpx
from nanovllm_testing.server import SERVER_ENGINE, ServerThread, start_server

from nanovllm_core.outputs import CompletionOutput
from nanovllm_core.serving.openai_serving import Job

__all__ = ["API_KEY", "ENGINE", "MODEL", "ScriptedJob", "ServerThread", "assert_shut_down_cleanly", "pieces_of",
           "start_serve_process", "start_server"]

ENGINE = SERVER_ENGINE
API_KEY = "test-key"
MODEL = "tiny-qwen3"


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


def assert_shut_down_cleanly(proc: subprocess.Popen, output: str) -> None:
    """The ``nanovllm serve`` process exited 0 and logged a clean shut-down, with no traceback (``output``: its
    whole output)."""
    assert proc.returncode == 0, output
    assert "shut down cleanly" in output
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output
