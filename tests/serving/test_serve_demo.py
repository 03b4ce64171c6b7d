"""``nanovllm serve --demo`` as a real process, as a user without a GPU or weights starts it: the demo checkpoint
under its name ``demo``, vLLM's ``VLLM_API_KEY`` honoured, vLLM's metric names on /metrics, a clean exit on
SIGTERM; and the same settings from vLLM's YAML ``--config``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from serving_helpers import start_serve_process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    return start_serve_process([*args, "--log-level", "warning"], port, env, timeout=120)


@pytest.mark.parametrize("from_yaml", [False, True], ids=["flags", "yaml-config"])
def test_serve_demo_with_vllms_api_key_variable(tmp_path: Path, from_yaml: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NANOVLLM_API_KEY", "VLLM_API_KEY")}
    env.update(NANOVLLM_CACHE=str(tmp_path / "cache"), VLLM_API_KEY="sk-vllm")
    flags = ["--demo", "--num-gpu-blocks-override", "64", "--block-size", "16"]
    if from_yaml:
        config = tmp_path / "config.yaml"
        config.write_text("demo: true\nnum-gpu-blocks-override: 64\nblock-size: 16\n")
        flags = ["--config", str(config)]
    port = free_port()
    proc = start(flags, port, env)
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        headers = {"Authorization": "Bearer sk-vllm"}
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["demo"] and models["data"][0]["max_model_len"] == 512
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'vllm:generation_tokens_total{model_name="demo"} 4.0' in metrics
        assert 'vllm:request_success_total{finished_reason="length",model_name="demo"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert (tmp_path / "cache" / "demo-qwen3-tiny" / "config.json").is_file()
