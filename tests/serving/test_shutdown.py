"""``nanovllm serve`` as a real process: SIGTERM lets the in-flight request finish and exits 0; SIGINT past the
shutdown deadline aborts it, its stream still ending with finish_reason "abort" and [DONE], and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess

import httpx
import pytest
from serving_helpers import assert_shut_down_cleanly, start_serve_process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(tiny_path, port: int, shutdown_timeout: float, *flags: str) -> subprocess.Popen:
    cmd = [str(tiny_path), *flags, "--device", "cpu", "--max-model-len", "1024"]
    cmd += ["--kvcache-block-size", "16", "--num-kvcache-blocks", "64"]
    cmd += ["--shutdown-timeout", str(shutdown_timeout), "--log-level", "warning"]
    return start_serve_process(cmd, port)


def stream_after_signal(port: int, proc: subprocess.Popen, sig: int, max_tokens: int) -> tuple[list[dict], bool]:
    """Start a stream, send ``sig`` once it has its first token, read what follows; (chunks, ended with DONE)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks, done = [], False
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 1:
                    proc.send_signal(sig)
    except httpx.RemoteProtocolError:
        pass  # the server closed the connection mid-stream: asserted against (done stays False)
    return chunks, done


@pytest.mark.parametrize(
    ("sig", "shutdown_timeout", "max_tokens", "finishes", "flags"),
    [
        (signal.SIGTERM, 30, 40, True, ()),
        # 1,000 tokens: more than the tiny model streams within the 0.5 s deadline on a 2-core CPU (480 was not)
        (signal.SIGINT, 0.5, 1000, False, ()),
        (signal.SIGTERM, 0.5, 1000, False, ("--no-engine-process",)),
    ],
    ids=["sigterm-drains", "sigint-aborts-at-deadline", "thread-sigterm-aborts"],
)
def test_signal_shuts_down_cleanly(tiny_path, sig, shutdown_timeout, max_tokens, finishes, flags):
    port = free_port()
    proc = start(tiny_path, port, shutdown_timeout, *flags)
    try:
        chunks, done = stream_after_signal(port, proc, sig, max_tokens)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_shut_down_cleanly(proc, output)
    finish_reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    if finishes:
        assert done and finish_reasons[-1] == "length"
    else:  # aborted at the deadline: fewer chunks than tokens asked for, and a stream that ends properly
        assert done and finish_reasons[-1] == "abort" and len(finish_reasons) < max_tokens
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
