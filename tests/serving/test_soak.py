"""benchmarks/soak.py's parts against a live server of the demo model's shape (each abusive request gets its
expected answer, a client that hangs up mid-stream leaves no KV block behind, the server's /metrics and memory
are read), and one short soak end to end through a real ``nanovllm serve`` process."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nanovllm_bench.serve import BenchRequest, client_session, request_headers
from nanovllm_testing import write_tiny_checkpoint
from nanovllm_testing.scripts import load_script
from serving_helpers import start_server

from nanovllm_core.serving.api_server import ServerSettings

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
BODY_LIMIT = 65536


soak = load_script(SOAK)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("soak-demo"), "qwen3")
    settings = ServerSettings(served_model_name="demo", max_request_body_bytes=BODY_LIMIT)
    thread = start_server(path, settings, max_model_len=soak.MAX_MODEL_LEN)
    yield thread
    thread.stop()


def test_each_abusive_request_gets_its_expected_answer(demo_server):
    request = BenchRequest([1, 2, 3], 4)

    async def send_all():
        async with client_session() as session:
            url = demo_server.url + "/v1/completions"
            return [
                await soak.send_bad(session, url, request_headers(None), kind, soak.bad_body(kind, request, BODY_LIMIT))
                for kind in soak.BAD_KINDS
            ]

    outcomes = asyncio.run(send_all())
    assert [o.unexpected for o in outcomes] == [""] * len(soak.BAD_KINDS)
    assert len(soak.bad_body("oversized", request, BODY_LIMIT)) > BODY_LIMIT
    stats = demo_server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_client_that_hangs_up_mid_stream_leaves_no_kv_block(demo_server):
    from nanovllm_bench.serve import request_body

    async def hang_up():
        async with client_session() as session:
            body = request_body(BenchRequest(list(range(40)), 200), None, 0.6)
            url = demo_server.url + "/v1/completions"
            return await soak.send_and_hang_up(session, url, request_headers(None), body, after=2)

    outcome = asyncio.run(hang_up())
    assert outcome.unexpected == "" and outcome.chunks_read >= 2
    stats = demo_server.wait_idle()
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    values = soak.metric_values(soak.fetch_metrics(demo_server.url))
    assert soak.kv_blocks_in_use(values) == 0 and values["nanovllm:num_kv_blocks"] == stats.num_kv_blocks


def test_request_kinds_memory_and_metrics_text():
    kinds = soak.draw_kinds(20000, 0.1, 0.01, seed=0)
    assert kinds == soak.draw_kinds(20000, 0.1, 0.01, seed=0)
    assert 1800 < kinds.count("disconnect") < 2200
    assert 150 < sum(kinds.count(k) for k in soak.BAD_KINDS) < 250 and all(k in kinds for k in soak.BAD_KINDS)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while str(child.pid) not in (usage := soak.memory(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(os.getpid()) in usage and str(child.pid) in usage and all(mb > 0 for mb in usage.values())
    finally:
        child.kill()
        child.wait()
    text = '# HELP x\nnanovllm:num_kv_blocks{model_name="m"} 64.0\nnanovllm:num_free_kv_blocks{model_name="m"} 60.0\n'
    assert soak.kv_blocks_in_use(soak.metric_values(text)) == 4
    assert soak.kv_blocks_in_use({"vllm:kv_cache_usage_perc": 0.0}) == 0 and soak.kv_blocks_in_use({}) is None


def test_bad_arguments_are_one_line_errors():
    for args, message in [
        (["--load", "1.5"], "--load 1.5: a fraction"),
        (["--num-requests", "0"], "--num-requests 0: at least 1"),
        (["--disconnect-fraction", "0.6", "--bad-fraction", "0.5"], "must leave some normal requests"),
        (["--input-len", "800"], "must fit max_model_len 1024"),
    ]:
        with pytest.raises(SystemExit, match=message):
            soak.check_args(soak.build_parser().parse_args(args))


def test_a_short_soak_end_to_end(tmp_path, monkeypatch):
    """A real `nanovllm serve` process of the demo checkpoint (written to a fresh cache), a few requests of each
    kind, every check passing and soak.json written."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--num-requests", "40", "--saturation-requests", "6", "--input-len", "8", "--output-len", "6"]
    argv += ["--disconnect-fraction", "0.2", "--bad-fraction", "0.2", "--port", str(port)]
    # a KV cache of 64 blocks (16k tokens, some 100 times what the run holds at once), not the CPU default's GiB,
    # which the server would take a second to allocate
    argv += ["--engine-args", "--num-kvcache-blocks 64"]
    assert soak.main([*argv, "--results-dir", str(tmp_path), "--start-timeout", "120"]) == 0
    report = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert report["num_requests"] == 40 and report["unexpected_errors"] == 0
    assert report["kv_blocks_in_use_after"] == 0 and report["server_exit_code"] == 0
    assert report["counts"]["disconnect"] > 0 and all(report["checks"].values())
    assert report["normal_completed"] == report["counts"]["normal"] and report["p99_e2el_ms"] > 0
    assert (tmp_path / "soak" / "server.log").is_file() and (tmp_path / "soak" / "metrics_after.txt").is_file()
