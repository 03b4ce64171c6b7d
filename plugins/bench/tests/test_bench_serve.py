"""``nanovllm bench serve`` against a live server (a tiny model whose vocabulary holds the workload's token ids):
the workloads, the metrics it reports, the --rates mode, vLLM's option names, defaults fitted to the server's model
(the demo's vocabulary and max_model_len), the SSE decoding of a stream cut anywhere, and its input checks."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanovllm_bench.offline import workload
from nanovllm_bench.serve import (
    SYNTH_RANGE,
    BenchRequest,
    SSEDecoder,
    fit_to_server,
    nano_workload,
    percentile,
    probe_server,
    random_dataset,
    request_headers,
    synthetic_sharegpt,
)
from nanovllm_testing import write_tiny_checkpoint
from nanovllm_testing.server import start_server

from nanovllm_core.cli import main
from nanovllm_core.errors import ConfigError
from nanovllm_core.serving.api_server import ServerSettings

METRICS = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("bench-tiny"), "qwen3", vocab_size=10240, hidden_size=32)
    thread = start_server(path, ServerSettings(served_model_name="bench"), max_model_len=512)
    yield thread
    thread.stop()


def test_nano_workload_through_the_server(bench_server, tmp_path):
    result_file = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--served-model-name", "bench", "--dataset", "nano"]
    argv += ["--num-prompts", "4", "--max-input-len", "100", "--max-output-len", "100", "--warmup", "2"]
    assert main([*argv, "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and math.isinf(result["request_rate"])
    assert result["total_input_tokens"] == 400 and result["total_output_tokens"] == 400  # randint(100, 100)
    assert result["output_throughput"] == pytest.approx(400 / result["duration"])
    for name in METRICS:
        assert 0 < result[f"median_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert 1.0 <= result["mean_tokens_per_chunk"] <= 100  # 4 x 100 tokens in at least one chunk each
    stats = bench_server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_rates_mode_writes_one_run_per_rate(bench_server, tmp_path, capsys):
    result_file = tmp_path / "rates.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "sharegpt-synth", "--num-prompts", "5"]
    argv += ["--rates", "50,inf", "--warmup", "0", "--max-concurrency", "3", "--result-file", str(result_file)]
    assert main([*argv, "--vocab-size", "400"]) == 0
    runs = json.loads(result_file.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [50, math.inf]
    assert all(r["completed"] == 5 and r["max_concurrency"] == 3 for r in runs)
    requests = synthetic_sharegpt(5, 400, 0)
    assert fit_to_server(requests, None, 512)  # one request is longer than the server's max_model_len 512
    expected = sum(r.max_tokens for r in requests)
    assert all(r["total_output_tokens"] == expected for r in runs)
    assert "request throughput" in capsys.readouterr().out


def test_server_metrics_after_each_run_hold_that_runs_tokens(bench_server, tmp_path):
    """--server-metrics: each run keeps the server's /metrics totals read after it, so the difference between two
    runs' is the later run's share (here its generated tokens and its requests)."""
    result_file = tmp_path / "metrics.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "sharegpt-synth", "--num-prompts", "4"]
    argv += ["--rates", "inf,inf", "--warmup", "0", "--vocab-size", "400", "--server-metrics"]
    assert main([*argv, "--result-file", str(result_file)]) == 0
    first, second = (run["server_metrics"] for run in json.loads(result_file.read_text())["runs"])
    tokens, requests = "nanovllm:generation_tokens_total", "nanovllm:e2e_request_latency_seconds_count"
    assert second[tokens] - first[tokens] == sum(r.max_tokens for r in fit_requests(4, 400))
    assert second[requests] - first[requests] == 4
    assert second["process_cpu_seconds_total"] >= first["process_cpu_seconds_total"] > 0
    assert not any(name.endswith("_bucket") for name in first)


def fit_requests(n: int, vocab: int) -> list[BenchRequest]:
    """sharegpt-synth's requests as the bench fits them to the test server (max_model_len 512)."""
    requests = synthetic_sharegpt(n, vocab, 0)
    fit_to_server(requests, None, 512)
    return requests


def test_priority_classes_are_sent_and_reported_each(bench_server, tmp_path, capsys):
    result_file = tmp_path / "classes.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "sharegpt-synth", "--num-prompts", "6"]
    argv += ["--warmup", "0", "--priorities", "0,1", "--result-file", str(result_file)]
    assert main(argv) == 0
    result = json.loads(result_file.read_text())
    assert sorted(result["by_priority"]) == ["0", "1"]
    assert [result["by_priority"][p]["completed"] for p in ("0", "1")] == [3, 3]
    assert "priority 1: 3 requests" in capsys.readouterr().out
    assert main([*argv[:-4], "--priorities", "high,low"]) != 0
    assert "comma-separated integers" in capsys.readouterr().err


def test_failed_requests_make_the_exit_status_1(bench_server, capsys):
    # token ids beyond the server's vocabulary: every request is rejected with a 400
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "sharegpt-synth", "--num-prompts", "2"]
    assert main([*argv, "--vocab-size", "100000", "--seed", "3", "--warmup", "0"]) == 1
    assert "HTTP 400" in capsys.readouterr().out


def test_trace_file_sends_its_requests_at_their_arrivals(bench_server, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"arrival": 0.0, "prompt_len": 30, "max_tokens": 4, "priority": 1},
        {"arrival": 0.6, "prompt": [1, 2, 3], "max_tokens": 2, "priority": 0},
        {"arrival": 0.3, "prompt_len": 5, "max_tokens": 3},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result_file = tmp_path / "trace.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", str(trace), "--warmup", "0"]
    assert main([*argv, "--client-processes", "2", "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 3 and result["arrivals"] == "trace"
    assert result["total_input_tokens"] == 38 and result["total_output_tokens"] == 9
    assert result["duration"] >= 0.6  # the last request went at its arrival, not at once
    assert sorted(result["by_priority"]) == ["0", "1"]
    assert main([*argv, "--num-prompts", "2", "--request-rate", "5"]) == 2
    err = capsys.readouterr().err
    assert "sending the first 2" in err and "carry their arrival times" in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt_len": 3}'], "line 1: 'max_tokens'"),
        (['{"prompt_len": 3, "max_tokens": 2, "arrival": 1}', '{"prompt_len": 3, "max_tokens": 2}'], "on every line"),
        (["[1, 2]"], "a JSON object per line"),
    ],
)
def test_bad_trace_is_one_clear_line(bench_server, tmp_path, lines, message, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["bench", "serve", "--base-url", bench_server.url, "--dataset", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert main(["bench", "serve", "--base-url", bench_server.url, "--dataset", "bogus"]) == 2
    assert "trace file ending in .jsonl" in capsys.readouterr().err


def test_workloads():
    prompts, max_tokens = workload(8, 1024, 1024)
    assert [(r.prompt, r.max_tokens) for r in nano_workload(8, 1024, 1024)] == list(zip(prompts, max_tokens))
    synth = synthetic_sharegpt(2000, 10000, 0)
    assert synth == synthetic_sharegpt(2000, 10000, 0)  # seeded
    lo, hi = SYNTH_RANGE
    assert all(lo <= len(r.prompt) <= hi and lo <= r.max_tokens <= hi for r in synth)
    assert 180 < sum(len(r.prompt) for r in synth) / 2000 < 260  # means stated in the docs: about 220 and 190
    assert 160 < sum(r.max_tokens for r in synth) / 2000 < 220


def test_random_dataset_lengths_and_errors(bench_server, tmp_path, capsys):
    fixed = random_dataset(50, 300, 20, 0.0, 1000, 0)
    assert {len(r.prompt) for r in fixed} == {300} and {r.max_tokens for r in fixed} == {20}
    assert all(0 <= t < 1000 for r in fixed for t in r.prompt)
    ranged = random_dataset(2000, 400, 100, 0.25, 10000, 1)
    assert ranged == random_dataset(2000, 400, 100, 0.25, 10000, 1)  # seeded
    assert min(len(r.prompt) for r in ranged) == 300 and max(len(r.prompt) for r in ranged) == 500
    assert min(r.max_tokens for r in ranged) == 75 and max(r.max_tokens for r in ranged) == 125
    assert 390 < sum(len(r.prompt) for r in ranged) / 2000 < 410
    result_file = tmp_path / "random.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "random", "--num-prompts", "3"]
    argv += ["--random-input-len", "40", "--random-output-len", "5", "--warmup", "0"]
    assert main([*argv, "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert result["total_input_tokens"] == 120 and result["total_output_tokens"] == 15
    assert result["dataset"] == "random"
    assert main([*argv, "--random-range-ratio", "1.5"]) == 2
    assert "--random-range-ratio 1.5: from 0" in capsys.readouterr().err
    assert main([*argv[:-4], "--random-input-len", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_percentile_and_bad_rates(capsys):
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) == 0.0
    assert percentile(list(range(101)), 90) == 90
    assert main(["bench", "serve", "--rates", "2,fast"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert main(["bench", "serve", "--num-prompts", "0"]) == 2


def test_client_processes_share_the_workload_and_report_their_loop_lag(bench_server, tmp_path, capsys):
    """--client-processes 2: request i from process i mod 2 (here the classes split that way too), every request
    once, the results in the workload's order, and the client event loops' lag beside the metrics."""
    result_file = tmp_path / "split.json"
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "random", "--num-prompts", "7"]
    argv += ["--random-input-len", "40", "--random-output-len", "5", "--warmup", "1", "--priorities", "0,1"]
    argv += ["--request-rate", "40", "--client-processes", "2"]
    assert main([*argv, "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 7 and result["failed"] == 0 and result["client_processes"] == 2
    assert [result["by_priority"][p]["completed"] for p in ("0", "1")] == [4, 3]
    assert result["total_input_tokens"] == 7 * 40 and result["total_output_tokens"] == 7 * 5
    assert 0 <= result["mean_client_loop_lag_ms"] <= result["max_client_loop_lag_ms"]
    assert 0 <= result["max_client_gc_pause_ms"]
    out = capsys.readouterr().out
    assert "client event loop lag ms (2 processes)" in out and "longest garbage collection" in out
    assert not multiprocessing.active_children()  # every client process was joined
    stats = bench_server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_no_server_is_one_line_error(capsys):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["bench", "serve", "--port", str(port), "--dataset", "random", "--num-prompts", "3"]
    assert main([*argv, "--random-input-len", "8", "--warmup", "0", "--client-processes", "2"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot reach the server at http://127.0.0.1:{port}: ClientConnectorError" in err
    assert len(err.strip().splitlines()) == 1
    assert not multiprocessing.active_children()


def test_client_processes_whose_every_request_fails_exit_1_and_leave_no_process(bench_server, capsys):
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "random", "--num-prompts", "3"]
    argv += ["--random-input-len", "8", "--vocab-size", "100000", "--seed", "1", "--warmup", "0"]
    assert main([*argv, "--client-processes", "2"]) == 1
    assert "3 failed" in capsys.readouterr().out
    assert not multiprocessing.active_children()


def test_client_processes_bad_input(bench_server, capsys):
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset", "sharegpt-synth", "--num-prompts", "2"]
    assert main([*argv, "--client-processes", "0"]) == 2
    assert "--client-processes 0: at least 1" in capsys.readouterr().err
    assert main([*argv, "--warmup", "0", "--client-processes", "3", "--max-concurrency", "2"]) == 2
    assert "each process needs at least one request in flight" in capsys.readouterr().err


def test_combined_summary_puts_each_share_back_in_order():
    from nanovllm_bench.serve import ClientShare, RequestResult, combined_summary

    def result(priority: int, tokens: int) -> RequestResult:
        return RequestResult(ok=True, prompt_tokens=1, output_tokens=tokens, ttft=0.01 * tokens, latency=1.0,
                             priority=priority)  # fmt: skip

    first = ClientShare([result(0, 1), result(0, 3)], start=10.0, end=12.0, loop_lags=[0.001, 0.003])
    second = ClientShare([result(1, 2)], start=10.5, end=13.0, loop_lags=[0.002])
    summary = combined_summary([first, second], [[0, 2], [1]])
    assert summary["duration"] == pytest.approx(3.0) and summary["completed"] == 3
    assert summary["by_priority"]["1"]["mean_ttft_ms"] == pytest.approx(20.0)
    assert summary["mean_client_loop_lag_ms"] == pytest.approx(2.0)
    assert summary["max_client_loop_lag_ms"] == pytest.approx(3.0)


def test_loop_lag_watcher_sees_a_blocked_event_loop():
    import asyncio
    import time

    from nanovllm_bench.serve import watch_loop_lag

    async def block() -> list[float]:
        samples: list[float] = []
        watcher = asyncio.ensure_future(watch_loop_lag(samples, interval=0.005))
        await asyncio.sleep(0.02)
        time.sleep(0.08)  # a callback that holds the loop, as a busy client's reads do
        await asyncio.sleep(0.02)
        watcher.cancel()
        return samples

    samples = asyncio.run(block())
    assert max(samples) >= 0.07 and min(samples) < 0.07


STREAM = (
    b": a comment\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b'data: {"b":\ndata: 2}\n\n'  # one event, two data lines
    b"event: ignored\rdata: [DONE]\r\r"
    b'data:{"c": 3}\n\n'
    b'data: {"unfinished"'
)
EVENTS = [b'{"a": 1}', b'{"b":\n2}', b"[DONE]", b'{"c": 3}']


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_sse_decoder_reads_a_stream_cut_anywhere(size):
    for offset in range(size):  # every cut position, with pieces of `size` bytes after the first
        pieces = [STREAM[:offset]] + [STREAM[i : i + size] for i in range(offset, len(STREAM), size)]
        decoder = SSEDecoder()
        events = [event for piece in pieces for event in decoder.feed(piece)]
        assert events == EVENTS, (size, offset)


def test_fit_to_server_wraps_ids_and_scales_lengths_down():
    requests = [BenchRequest([5, 400, 1000], 10), BenchRequest(list(range(900)), 300), BenchRequest([1] * 10, 2000)]
    notices = fit_to_server(requests, 384, 1024)
    assert requests[0].prompt == [5, 400 % 384, 1000 % 384] and requests[0].max_tokens == 10
    assert (len(requests[1].prompt), requests[1].max_tokens) == (900 * 1024 // 1200, 1024 - 768)
    assert requests[1].prompt == [t % 384 for t in range(768)]  # the prompt's start
    assert (len(requests[2].prompt), requests[2].max_tokens) == (5, 1019)
    assert all(len(r.prompt) + r.max_tokens <= 1024 for r in requests)
    assert notices == [
        "token ids taken modulo the server's vocabulary size 384",
        "2 of 3 requests longer than the server's max_model_len 1024 (prompt + output tokens): both lengths scaled "
        "down to fit",
    ]
    assert fit_to_server(requests, 384, 1024) == [] and fit_to_server(requests, None, None) == []


def test_probe_reads_max_model_len_and_the_ids_the_model_takes(bench_server, demo_server):
    """The model's vocabulary (10,240 here), not its tokenizer's (smaller), bounds the ids a prompt may hold."""
    import asyncio

    def probe(server, largest: int, model: str | None = None):
        coro = probe_server(server.url, "/v1/completions", request_headers(None), model, largest)
        return asyncio.run(coro)

    info, model = probe(bench_server, 10000)
    assert (info.model_ids, info.max_model_len, info.vocab_size, model) == (["bench"], 512, None, "bench")
    assert len(bench_server.engine.tokenizer) < 10000
    assert probe(bench_server, 20000)[0].vocab_size == 10240
    assert probe(demo_server, 10000)[0].vocab_size == 384
    with pytest.raises(ConfigError, match="a one-token request to .* answered HTTP 404: .*model"):
        probe(bench_server, 20000, "no-such-model")


def test_vllm_option_names(bench_server, tmp_path, capsys):
    """A vllm bench serve command line: --host/--port, --endpoint, --dataset-name, --save-result with --result-dir and
    --result-filename, --metric-percentiles and --percentile-metrics; the model name from /v1/models."""
    argv = ["bench", "serve", "--host", "127.0.0.1", "--port", str(bench_server.port), "--endpoint", "/v1/completions"]
    argv += ["--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "30", "--random-output-len", "4"]
    argv += ["--request-rate", "100", "--max-concurrency", "2", "--seed", "3", "--ignore-eos", "--warmup", "0"]
    argv += ["--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json"]
    assert main([*argv, "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99.9"]) == 0
    result = json.loads((tmp_path / "out" / "r.json").read_text())
    assert result["completed"] == 3 and result["dataset"] == "random" and result["model_id"] == "bench"
    assert result["total_input_tokens"] == 90 and result["max_concurrency"] == 2
    for metric in ("ttft", "itl"):
        assert result[f"p50_{metric}_ms"] == result[f"median_{metric}_ms"]
        assert result[f"p99_{metric}_ms"] <= result[f"p99.9_{metric}_ms"]
    assert "p99.9_tpot_ms" not in result and "p90_e2el_ms" in result  # the usual keys stay
    out = capsys.readouterr().out
    assert " TTFT ms: mean" in out and "p99.9" in out and "E2EL" not in out
    # --save-result alone: vLLM's default name, in the current folder
    argv = ["bench", "serve", "--base-url", bench_server.url, "--dataset-name", "random", "--num-prompts", "2"]
    argv += ["--random-input-len", "8", "--random-output-len", "2", "--warmup", "0", "--max-concurrency", "2"]
    assert main([*argv, "--save-result", "--result-dir", str(tmp_path)]) == 0
    (saved,) = tmp_path.glob("nanovllm-infqps-concurrency2-bench-*.json")
    assert json.loads(saved.read_text())["completed"] == 2


def test_vllm_option_bad_input(bench_server, capsys):
    argv = ["bench", "serve", "--base-url", bench_server.url, "--num-prompts", "2", "--warmup", "0"]
    assert main([*argv, "--endpoint", "v1/completions"]) == 2
    assert "--endpoint 'v1/completions': a path starting with /" in capsys.readouterr().err
    assert main([*argv, "--metric-percentiles", "99,101"]) == 2
    assert "--metric-percentiles '99,101': comma-separated numbers above 0 up to 100" in capsys.readouterr().err
    assert main([*argv, "--percentile-metrics", "ttft,latency"]) == 2
    assert "out of ttft, tpot, itl, e2el" in capsys.readouterr().err
    assert main([*argv, "--vocab-size", "0"]) == 2
    assert "--vocab-size 0: at least 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The demo model's shape: a vocabulary of 384 token ids and max_model_len 1024."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("demo-shape"), "qwen3")
    thread = start_server(path, ServerSettings(served_model_name="demo"), max_model_len=1024)
    yield thread
    thread.stop()


@pytest.mark.parametrize("dataset", ["nano", "random", "sharegpt-synth"])
def test_defaults_fit_the_demo_model(demo_server, dataset, tmp_path, capsys):
    """Only the server and a small count given: every request fits the demo's vocabulary and context."""
    assert len(demo_server.engine.tokenizer) == 384 and demo_server.engine.max_model_len == 1024
    result_file = tmp_path / "demo.json"
    argv = ["bench", "serve", "--base-url", demo_server.url, "--dataset-name", dataset, "--num-prompts", "3"]
    assert main([*argv, "--warmup", "1", "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 3 and result["failed"] == 0
    err = capsys.readouterr().err
    if dataset == "nano":  # nano-vllm's ids (up to 10,000) and lengths (up to 1,024 + 1,024)
        assert "bench serve: token ids taken modulo the server's vocabulary size 384" in err
        assert "requests longer than the server's max_model_len 1024" in err
    if dataset == "random":  # 1,024 prompt tokens + 128
        assert "bench serve: 3 of 3 requests longer than the server's max_model_len 1024" in err
    assert result["total_input_tokens"] + result["total_output_tokens"] <= 3 * 1024
    stats = demo_server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
