"""``nanovllm simulate``: deterministic, per-class metrics that show a starved class, a calibration that recovers
the model it was fitted on, and the same scheduling decisions as the real engine (only time is simulated)."""

from __future__ import annotations

import gc
import json
import random

import pytest
from nanovllm_bench.serve import summarize
from nanovllm_bench.simulate import Calibration, TraceRequest, TraceSimulator, load_calibration, shipped_calibrations
from nanovllm_bench.simulate.cost import FEATURES, fit_records
from nanovllm_bench.simulate.run import DEFAULT_CALIBRATION, client_results, poisson_arrivals
from nanovllm_scheduler_fifo.scheduler import FifoScheduler

from nanovllm_core.cli import main as cli_main
from nanovllm_core.errors import ConfigError

COEF = {"fixed": 1.5, "per_seq": 0.002, "per_kv_token": 3e-5, "per_prompt_token": 0.002, "per_prompt_pair": 0.0}


def small_calibration(**kwargs) -> Calibration:
    fields = dict(coefficients_ms=dict(COEF), num_kvcache_blocks=64, kvcache_block_size=16)
    fields.update(kwargs)
    return Calibration(**fields)


def trace(n: int, seed: int, rate: float, priorities: tuple[int, ...] = ()) -> list[TraceRequest]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(n, rate, seed)
    return [
        TraceRequest(
            t,
            [rng.randrange(3, 300) for _ in range(rng.randint(5, 90))],
            rng.randint(2, 40),
            priorities[i % len(priorities)] if priorities else None,
        )
        for i, t in enumerate(arrivals)
    ]


def simulate(scheduler="fifo", requests=None, **kwargs):
    engine = TraceSimulator(
        small_calibration(), scheduler=scheduler, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512,
        **kwargs,
    )
    times = engine.replay(requests if requests is not None else trace(60, 1, 200.0))
    return engine, times


def test_same_seed_same_run():
    a, ta = simulate(requests=trace(60, 3, 150.0))
    b, tb = simulate(requests=trace(60, 3, 150.0))
    assert a.steps == b.steps and a.timeline == b.timeline
    assert [t.token_times for t in ta] == [t.token_times for t in tb]
    c, tc = simulate(requests=trace(60, 4, 150.0))
    assert [t.token_times for t in tc] != [t.token_times for t in ta]


def test_every_request_gets_its_tokens_after_it_arrives():
    engine, times = simulate(requests=trace(40, 5, 100.0))
    for t in times:
        assert len(t.token_times) == t.request.max_tokens
        assert t.token_times[0] > t.request.arrival
        assert t.token_times == sorted(t.token_times)
    assert engine.now >= max(t.token_times[-1] for t in times)


def test_idle_time_jumps_to_the_next_arrival():
    late = TraceRequest(100.0, [5] * 20, 3)
    engine, times = simulate(requests=[TraceRequest(0.0, [4] * 20, 3), late])
    assert times[1].token_times[0] > 100.0
    assert engine.steps < 20  # no steps were spent waiting


def test_async_scheduling_overlaps_the_host_with_the_gpu():
    requests = trace(30, 6, 1000.0)
    cal = small_calibration(host_gap_ms=1.0)
    on = TraceSimulator(cal, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
    on.replay([TraceRequest(r.arrival, r.prompt, r.max_tokens) for r in requests])
    off = TraceSimulator(cal, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, async_scheduling=False)
    off.replay([TraceRequest(r.arrival, r.prompt, r.max_tokens) for r in requests])
    assert on.now < off.now


def test_the_cycle_collector_is_back_on_after_a_run_even_a_failed_one():
    assert gc.isenabled()
    simulate()
    assert gc.isenabled()
    engine = TraceSimulator(small_calibration(), max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
    with pytest.raises(RuntimeError, match="more than 3 steps"):
        engine.replay(trace(10, 2, float("inf")), max_steps=3)
    assert gc.isenabled()


class ClassZeroFirst(FifoScheduler):
    """Starves class 1: a waiting class-0 sequence always goes ahead of every waiting class-1 one."""

    def enqueue(self, seq) -> None:
        if seq.sampling_params.priority == 0:
            position = next((i for i, s in enumerate(self.waiting) if s.sampling_params.priority != 0), None)
            if position is not None:
                self.waiting.insert(position, seq)
                return
        self.waiting.append(seq)


def test_a_policy_that_starves_a_class_shows_it_per_class():
    requests = trace(120, 7, float("inf"), priorities=(0, 1))  # overload: everything at once
    _, fair = simulate("fifo", [TraceRequest(r.arrival, r.prompt, r.max_tokens, r.priority) for r in requests])
    _, starved = simulate(ClassZeroFirst, requests)
    fair_summary = summarize(client_results(fair, {}), 1.0)["by_priority"]
    summary = summarize(client_results(starved, {}), 1.0)["by_priority"]
    assert summary["1"]["median_ttft_ms"] > 2 * summary["0"]["median_ttft_ms"]
    assert summary["0"]["median_ttft_ms"] < fair_summary["0"]["median_ttft_ms"]
    ratio = fair_summary["1"]["median_ttft_ms"] / fair_summary["0"]["median_ttft_ms"]
    assert 0.5 < ratio < 2  # fifo treats both classes alike


def test_fit_recovers_a_known_linear_model():
    rng = random.Random(0)
    records = []
    for _ in range(300):
        seqs = rng.randint(1, 256)
        kv = seqs * rng.randint(100, 2000)
        records.append((seqs, seqs, kv))  # decode
    for _ in range(20):
        seqs = rng.randint(1, 40)
        query = seqs + rng.randint(500, 16000)
        records.append((seqs, query, query + rng.randint(0, 50000)))
    want = [COEF[f] for f in FEATURES]
    rows = [(s, q, k, want[0] + want[1] * s + want[2] * k + want[3] * (q - s)) for s, q, k in records]
    coef, quality = fit_records(rows)
    for name in FEATURES:
        assert coef[name] == pytest.approx(COEF[name], rel=1e-6, abs=1e-9)
    assert quality["r2"] == pytest.approx(1.0)


EAGER = {**COEF, "per_prompt_pair": 4e-7, "per_prompt_step": 0.5, "eager_per_prompt_token": 8e-4, "eager_floor": 12.0}


def format2_records(rng: random.Random) -> list[tuple[int, int, int, float]]:
    """Steps priced by a known format-2 model (graph limit 2,048): decodes, graph-replayed single prompts, eager
    steps of one long prompt (under the host floor) and of many short ones (above it)."""
    cal = small_calibration(coefficients_ms=dict(EAGER), graph_max_tokens=2048)
    shapes = []
    for _ in range(200):
        seqs = rng.randint(1, 256)
        shapes.append((seqs, seqs, seqs * rng.randint(100, 3000)))
    shapes += [(1, n, n) for n in (rng.randint(200, 2048) for _ in range(20))]  # one prompt: pairs exact
    shapes += [(1, n, n) for n in (rng.randint(2100, 4096) for _ in range(30))]
    shapes += [(32, n, n) for n in (rng.randint(14000, 16384) for _ in range(10))]
    return [(s, q, k, cal.step_ms(s, q, k, q * q / (2 * s) + q / 2 if q > s else 0.0)) for s, q, k in shapes]


def test_fit_recovers_eager_steps_and_prompt_attention():
    records = format2_records(random.Random(2))
    coef, quality = fit_records(records, graph_max_tokens=2048)
    assert quality["graph_max_tokens"] == 2048 and quality["eager_prompt_steps"] == 40
    for name, want in EAGER.items():
        assert coef[name] == pytest.approx(want, rel=1e-6, abs=1e-9), name
    assert quality["r2"] == pytest.approx(1.0)
    # a long lone prompt above the graphs costs the host's floor, not the line: the first format priced it less
    cal = small_calibration(coefficients_ms=coef, graph_max_tokens=2048)
    assert cal.step_ms(1, 2500, 2500, 2500 * 1250.5) == pytest.approx(12.0)
    assert small_calibration(coefficients_ms=coef).step_ms(1, 2500, 2500, 2500 * 1250.5) < 12.0


def test_recorded_pairs_price_chunks_deep_into_long_prompts():
    """A 2,048-token chunk after 30k cached tokens attends to 30x the keys of a first chunk: with the pairs the
    runner records the fit recovers the model, while estimated from the step's shape alone (a chunk from the
    start of its prompt) the pairs cannot explain such steps."""
    rng = random.Random(4)
    cal = small_calibration(coefficients_ms=dict(EAGER), graph_max_tokens=2048)
    records = [(*r, r[1] * r[1] / 2 + r[1] / 2 if r[1] > r[0] else 0.0) for r in format2_records(rng) if r[1] <= 2048]
    for _ in range(40):
        cached, decodes = rng.randint(0, 30000), rng.randint(0, 64)
        chunk = 2048 - decodes  # a step of 2,048 tokens: the decodes and a chunk of one prompt
        pairs = chunk * cached + chunk * (chunk + 1) / 2
        s, q, k = decodes + 1, 2048, decodes * 1000 + cached + chunk
        records.append((s, q, k, cal.step_ms(s, q, k, pairs), pairs, cached + chunk))  # and the longest context
    coef, quality = fit_records(records, graph_max_tokens=2048)
    assert coef["per_prompt_pair"] == pytest.approx(EAGER["per_prompt_pair"], rel=1e-6)
    assert quality["r2"] == pytest.approx(1.0)
    _, estimated = fit_records([r[:4] for r in records], graph_max_tokens=2048)
    assert estimated["r2_prompt_steps"] < 0.99


def test_prompt_steps_without_decodes_get_a_term_of_their_own_where_the_records_say_which_they_are():
    """``fifo``'s prompt steps carry no decode; ``mixed``'s carry some. Priced 0.2 ms apart, the fit recovers the
    difference from records with their rows of one query token, and the simulator charges it to a step of prompts
    alone; records without that column fit no such term."""
    rng = random.Random(5)
    truth = {**EAGER, "per_prompt_only_step": -0.2}
    cal = small_calibration(coefficients_ms=truth, graph_max_tokens=2048)
    records = []
    for _ in range(200):  # decode steps
        seqs = rng.randint(1, 256)
        k = seqs * rng.randint(100, 3000)
        records.append((seqs, seqs, k, cal.step_ms(seqs, seqs, k, 0.0, seqs), 0.0, 3000, seqs))
    for _ in range(60):  # one prompt alone, or beside decodes
        decodes, prompt = rng.choice([0, rng.randint(1, 64)]), rng.randint(16, 1500)
        s, q, k, pairs = decodes + 1, decodes + prompt, decodes * 1000 + prompt, prompt * (prompt + 1) / 2
        longest = max(prompt, 1000 * (decodes > 0))
        records.append((s, q, k, cal.step_ms(s, q, k, pairs, decodes), pairs, longest, decodes))
    coef, quality = fit_records(records, graph_max_tokens=2048)
    assert coef["per_prompt_only_step"] == pytest.approx(-0.2, abs=1e-6)
    assert coef["per_prompt_step"] == pytest.approx(EAGER["per_prompt_step"], abs=1e-6)
    assert quality["r2"] == pytest.approx(1.0)
    assert "per_prompt_only_step" not in fit_records([r[:6] for r in records], graph_max_tokens=2048)[0]
    fitted = small_calibration(coefficients_ms=coef, graph_max_tokens=2048)
    alone, beside = fitted.step_ms(1, 300, 300, 45150.0, 0), fitted.step_ms(2, 301, 1300, 45150.0, 1)
    assert beside - alone == pytest.approx(0.2 + EAGER["per_seq"] + 1000 * EAGER["per_kv_token"])
    assert fitted.step_ms(1, 300, 300, 45150.0) == pytest.approx(alone + 0.2)  # rows not known: priced with decodes
    # the simulated engine says how many rows of each step decode: fifo's lone prompt is priced as one
    engine = TraceSimulator(fitted, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096)
    [times] = engine.replay([TraceRequest(0.0, [5] * 300, 1)])
    assert times.token_times[0] == pytest.approx(alone / 1e3)


def test_the_runner_records_the_pairs_the_simulator_prices():
    from nanovllm_core.engine.input_batch import HostBatch, one_token_rows, prompt_pairs

    # a decode (1 token after 99), a 3-token chunk after 10 cached, a whole 5-token prompt
    host = HostBatch(input_ids=[0] * 9, positions=[], slot_mapping=[], query_start_loc=[0, 1, 4, 9],
                     seq_lens=[100, 13, 5], max_blocks=1, max_query_len=5, logits_indices=[],
                     sample_rows=[])  # fmt: skip
    assert prompt_pairs(host) == 3 * (10 + 4 / 2) + 5 * (0 + 6 / 2) and one_token_rows(host) == 1
    host.query_start_loc, host.seq_lens, host.input_ids = [0, 1, 2], [7, 9], [0, 0]
    assert prompt_pairs(host) == 0.0 and one_token_rows(host) == 2


def test_too_few_graph_replayed_prompt_steps_fit_the_first_format():
    records = [r for r in format2_records(random.Random(3)) if not r[1] > r[0] or r[1] > 2048]
    coef, quality = fit_records(records, graph_max_tokens=2048, pair_ms=3e-7)
    assert quality["graph_max_tokens"] is None and quality["eager_prompt_steps"] == 0
    assert coef["per_prompt_pair"] == 3e-7 and "eager_floor" not in coef


def test_a_first_format_calibration_reads_and_prices_as_before(tmp_path):
    data = json.loads(small_calibration().to_json())
    data["format"] = "nanovllm-step-cost/1"
    del data["graph_max_tokens"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    cal = load_calibration(str(path))
    assert cal.graph_max_tokens is None
    assert cal.step_ms(2, 8000, 9000, 1e6) == pytest.approx(1.5 + 0.002 * 2 + 3e-5 * 9000 + 0.002 * 7998)
    data["format"] = "nanovllm-step-cost/0"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="format 'nanovllm-step-cost/0', expected one of"):
        load_calibration(str(path))


def test_calibrate_round_trip_through_the_cli(tmp_path, capsys):
    rng = random.Random(1)
    records = []
    for _ in range(200):
        seqs = rng.randint(1, 128)
        records.append([seqs, seqs, seqs * rng.randint(50, 900)])
    for _ in range(10):
        records.append([30, 15000 + rng.randint(0, 1000), 16000 + rng.randint(0, 1000)])
    for r in records:
        s, q, k = r
        r.append(COEF["fixed"] + COEF["per_seq"] * s + COEF["per_kv_token"] * k + COEF["per_prompt_token"] * (q - s))
    bench = {
        "model": "/tmp/nanovllm-bench-qwen3-0.6b-bfloat16",
        "device": "NVIDIA H200",
        "dtype": "torch.bfloat16",
        "kv_cache_dtype": "auto",
        "attention": "triton",
        "tensor_parallel_size": 1,
        "num_kvcache_blocks": 4000,
        "steps": len(records),
        "gpu_idle_s": 0.05,
        "gemm_flop_per_s": 8e14,
        "step_records": records,
    }
    path, out = tmp_path / "bench.json", tmp_path / "cal.json"
    path.write_text(json.dumps(bench))
    assert cli_main(["simulate", "--calibrate", str(path), "--out", str(out), "--commit", "abc1234"]) == 0
    cal = load_calibration(str(out))
    assert cal.gpu == "NVIDIA H200" and cal.model == "qwen3-0.6b" and cal.commit == "abc1234"
    assert cal.num_kvcache_blocks == 4000 and cal.shape["num_layers"] == 28
    assert cal.step_ms(64, 64, 20000) == pytest.approx(1.5 + 0.002 * 64 + 3e-5 * 20000, rel=1e-6)
    assert cal.coefficients_ms["per_prompt_pair"] == pytest.approx(1e3 * 4 * 28 * 16 * 128 / 8e14)
    assert cal.host_gap_ms == pytest.approx(1e3 * 0.05 / len(records))

    # the front-end from a server's timelines, its pipe to the engine and the client's part from an idle server's
    timeline = tmp_path / "timeline.jsonl"
    timeline.write_text("".join(
        json.dumps({"request_id": str(i), "num_prompt_tokens": 1000 * i, "received": 10.0 + i,
                    "handed": 10.0 + i + (0.5 + 0.1 * i) / 1e3, "engine_arrival": 10.0 + i + 0.009}) + "\n"
        for i in range(1, 9)
    ))  # fmt: skip
    idle = tmp_path / "idle.json"
    stages = lambda ms: {"stages_ms": {"handed -> engine_arrival": ms}}  # noqa: E731
    idle.write_text(json.dumps({"long": {"prompt_tokens": 20000, "outside_server_ms": 1.0, **stages(1.9)},
                                "short": {"prompt_tokens": 0, "outside_server_ms": 0.6, **stages(0.3)}}))  # fmt: skip
    argv = ["simulate", "--calibrate", str(path), "--out", str(out), "--request-timelines", str(timeline)]
    assert cli_main([*argv, "--client-timings", str(idle)]) == 0
    frontend = load_calibration(str(out)).frontend
    assert frontend["hop_ms"] == pytest.approx(0.3) and frontend["hop_ms_per_1k_prompt_tokens"] == pytest.approx(0.08)
    assert frontend["intake_ms"] == pytest.approx(0.5 + 0.3)  # the front-end's line, then the idle pipe
    assert frontend["intake_ms_per_1k_prompt_tokens"] == pytest.approx(0.1 + 0.08)
    assert frontend["client_ms"] == pytest.approx(0.6) and frontend["client_ms_per_1k_prompt_tokens"] == 0.02
    idle.write_text(json.dumps({"short": {"prompt_tokens": 200, "outside_server_ms": 0.6}}))  # no stages: an older file
    assert cli_main([*argv, "--client-timings", str(idle)]) == 0
    frontend = load_calibration(str(out)).frontend
    assert frontend["hop_ms"] == pytest.approx(9.0 - 0.5 - 0.1 * 8, abs=1e-6)  # the timelines' lower decile
    assert frontend["hop_source"] == "the lower decile under load"
    # with the front-end's CPU probe the calibration queues the front-end, and says with what
    probe = {"prompt_tokens": 200, "ms_per_request": 1.4, "ms_per_output_token": 0.05, "ms_per_step": 0.2}
    idle.write_text(json.dumps({"short": {"prompt_tokens": 200, "outside_server_ms": 0.6}, "frontend_cpu": probe}))
    capsys.readouterr()
    assert cli_main([*argv, "--client-timings", str(idle)]) == 0
    assert load_calibration(str(out)).frontend["output_cpu_ms_per_step"] == 0.2
    assert ("queued on one CPU: 1.400 ms a request of 200 prompt tokens and one output token, 0.0500 ms each further "
            "token, 0.2000 ms each step's outputs (idle.json)") in capsys.readouterr().out


def test_shipped_calibrations_load_with_provenance():
    names = shipped_calibrations()
    assert {"h200-qwen3-0.6b-bf16", "h200-qwen3-0.6b-fp8", "h200-qwen3-8b-bf16", "h200-qwen3-8b-fp8",
            "h100-qwen3-0.6b-bf16"} <= set(names)  # fmt: skip
    for name in names:
        cal = load_calibration(name)
        gpu = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}[name.split("-")[0]]
        assert cal.gpu == gpu and cal.commit != "unknown" and cal.date != "unknown"
        assert cal.fit["r2"] > 0.9
        assert cal.step_ms(1, 1, 100) > 0 and cal.step_ms(1, 4096, 4096, 4096 * 2048) > cal.step_ms(1, 1, 100)
    with pytest.raises(ConfigError, match="shipped"):
        load_calibration("no-such-calibration")


def test_cli_runs_a_workload_and_writes_the_metrics(tmp_path, capsys):
    result = tmp_path / "r.json"
    code = cli_main(
        [
            "simulate", "--dataset", "sharegpt-synth", "--num-prompts", "40", "--request-rate", "20",
            "--priorities", "0,1", "--scheduler", "priority", "--result-file", str(result),
        ]
    )
    assert code == 0
    data = json.loads(result.read_text())
    assert data["completed"] == 40 and set(data["by_priority"]) == {"0", "1"}
    assert data["simulated"]["timeline"] and data["simulated"]["simulated_s"] > 0
    assert "simulated s per wall-clock s" in capsys.readouterr().out


def test_graph_limit_prices_larger_prompt_steps_as_graph_replays(tmp_path):
    """A 3,000-token prompt is above the shipped calibrations' limit (their servers' 2,048), so it is priced at
    the eager floor; with the engine's limit raised past it, along the graph-replayed steps' line."""
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"arrival": 0.0, "prompt_len": 3000, "max_tokens": 1}) + "\n")
    ttft = {}
    for limit in (None, 2048, 8192):
        result = tmp_path / f"r{limit}.json"
        flags = [] if limit is None else ["--cuda-graph-max-mixed-tokens", str(limit)]
        assert cli_main(["simulate", "--dataset", str(path), "--result-file", str(result), *flags]) == 0
        ttft[limit] = json.loads(result.read_text())["median_ttft_ms"]
    cal = load_calibration(DEFAULT_CALIBRATION)
    assert cal.graph_max_tokens == 2048
    assert ttft[None] == ttft[2048] > cal.coefficients_ms["eager_floor"] > ttft[8192]


def test_trace_file_keeps_its_arrivals(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"arrival": 0.0, "prompt_len": 30, "max_tokens": 4},
        {"arrival": 2.5, "prompt": [1, 2, 3], "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = tmp_path / "r.json"
    assert cli_main(["simulate", "--dataset", str(path), "--result-file", str(result)]) == 0
    data = json.loads(result.read_text())
    assert data["completed"] == 2 and data["duration"] > 2.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "bogus"], "--dataset 'bogus'"),
        (["--scheduler", "nope"], "no scheduler named 'nope'"),
        (["--scheduler-options", "[1]"], "a JSON object"),
        (["--request-rate", "0"], "must be > 0"),
        (["--calibration", "nope"], "shipped:"),
        (["--plot", "x.png"], "--sweep-rates"),
        (["--cuda-graph-max-mixed-tokens", "-1"], "give 0 or more"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert cli_main(["simulate", "--num-prompts", "5", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_bad_trace_line_names_the_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 3, "max_tokens": 2}\n{"prompt_len": 3}\n')
    assert cli_main(["simulate", "--dataset", str(path)]) == 2
    assert "line 2: 'max_tokens'" in capsys.readouterr().err


def test_sweep_plot_needs_matplotlib_or_draws(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    argv = ["simulate", "--num-prompts", "20", "--sweep-rates", "10,40", "--scheduler", "fifo", "--scheduler", "mixed"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cli_main([*argv, "--plot", str(png)]) == 2
        assert "--plot needs matplotlib" in capsys.readouterr().err
        assert cli_main([*argv, "--result-file", str(tmp_path / "r.json")]) == 0
        runs = json.loads((tmp_path / "r.json").read_text())["runs"]
        assert [(r["scheduler"], r["request_rate"]) for r in runs] == [
            ("fifo", 10.0), ("fifo", 40.0), ("mixed", 10.0), ("mixed", 40.0)
        ]
    else:
        assert cli_main([*argv, "--plot", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_request_timelines_fit_the_front_end_per_request_and_per_prompt_token(tmp_path):
    """A server's timelines whose intake is 2 ms + 0.5 ms per 1k prompt tokens, and 0.3 ms from the engine's first
    token to the front-end's: the fit finds both, and the simulator admits a long prompt that much later."""
    from nanovllm_bench.simulate.cost import frontend_from_timelines

    rng = random.Random(0)
    lines = [json.dumps({"clock": "time.monotonic", "monotonic": 0.0, "unix": 0.0, "stages": []})]
    for i in range(50):
        prompt = rng.randint(10, 30000)
        received = 100.0 + i
        arrival = received + (2.0 + 0.5 * prompt / 1e3) / 1e3
        lines.append(json.dumps({"request_id": str(i), "num_prompt_tokens": prompt, "received": received,
                                 "engine_arrival": arrival, "first_token": arrival + 0.05,
                                 "first_token_delivered": arrival + 0.0503}))  # fmt: skip
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(lines) + "\n")
    frontend = frontend_from_timelines([str(path)])
    assert frontend["intake_ms"] == pytest.approx(2.0, abs=1e-6)
    assert frontend["intake_ms_per_1k_prompt_tokens"] == pytest.approx(0.5, abs=1e-6)
    assert frontend["delivery_ms"] == pytest.approx(0.3, abs=1e-6) and frontend["requests"] == 50
    engine = TraceSimulator(small_calibration(frontend=frontend), max_num_seqs=8, max_num_batched_tokens=128,
                             max_model_len=512)  # fmt: skip
    short, long = TraceRequest(0.0, [5] * 10, 2), TraceRequest(5.0, [6] * 400, 2)
    times = {t.request.arrival: t for t in engine.replay([short, long])}
    assert times[0.0].admitted == pytest.approx(0.002 + 0.5e-6 * 10)
    assert times[5.0].admitted == pytest.approx(5.0 + 0.002 + 0.5e-6 * 400)


def test_timelines_with_a_hand_over_count_the_front_end_and_the_pipe_not_the_wait_for_a_step(tmp_path):
    """The front-end takes 1 ms + 0.3 ms per 1k prompt tokens to hand a request over; the pipe to the engine 0.4
    ms, and most requests then wait up to 5 ms for the running step, which the simulated engine adds itself: the
    intake is the front-end's line plus the pipe alone."""
    from nanovllm_bench.simulate.cost import frontend_from_timelines

    rng = random.Random(1)
    lines = []
    for i in range(200):
        prompt = rng.randint(10, 20000)
        received = 10.0 + i
        handed = received + (1.0 + 0.3 * prompt / 1e3) / 1e3
        wait = 0.0 if i % 5 == 0 else rng.uniform(0.5, 5.0)
        arrival = handed + (0.4 + wait) / 1e3
        lines.append(json.dumps({"request_id": str(i), "num_prompt_tokens": prompt, "received": received,
                                 "validated": handed, "handed": handed, "engine_arrival": arrival}))  # fmt: skip
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(lines) + "\n")
    frontend = frontend_from_timelines([str(path)])
    assert frontend["hop_ms"] == pytest.approx(0.4, abs=1e-6)
    assert frontend["intake_ms"] == pytest.approx(1.4, abs=1e-6)
    assert frontend["intake_ms_per_1k_prompt_tokens"] == pytest.approx(0.3, abs=1e-6)


def test_timelines_fit_the_typical_request_not_a_bursts_queue(tmp_path):
    """A sixth of the requests arrive in a burst and queue 20 ms in the front-end (and 5 ms for their first token's
    hand-over): the fit is the median line of the others' 0.8 ms + 0.2 ms per 1k prompt tokens and their 0.3 ms
    hand-over, where a mean would add about 3 ms and 0.8 ms."""
    from nanovllm_bench.simulate.cost import frontend_from_timelines

    rng = random.Random(2)
    lines = []
    for i in range(240):
        prompt = rng.randint(10, 8000)
        queued = 20.0 if i % 6 == 0 else 0.0
        received = 10.0 + i
        handed = received + (0.8 + 0.2 * prompt / 1e3 + queued) / 1e3
        first_token = handed + 0.004
        lines.append(json.dumps({"request_id": str(i), "num_prompt_tokens": prompt, "received": received,
                                 "handed": handed, "engine_arrival": handed + 0.0005, "first_token": first_token,
                                 "first_token_delivered": first_token + (5.0 if queued else 0.3) / 1e3}))  # fmt: skip
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(lines) + "\n")
    frontend = frontend_from_timelines([str(path)])
    assert frontend["intake_ms"] == pytest.approx(0.8 + 0.5, abs=1e-3)
    assert frontend["intake_ms_per_1k_prompt_tokens"] == pytest.approx(0.2, abs=1e-4)
    assert frontend["delivery_ms"] == pytest.approx(0.3, abs=1e-6)


def test_client_timings_add_the_clients_way_in_and_out_to_each_first_token_and_latency(tmp_path):
    """request_timeline.py's figures (the client saw 1.2 ms more than the server for a 20k-token prompt, 0.8 ms for
    a 200-token one): a line over the prompt length, added to every simulated request's TTFT and latency."""
    from nanovllm_bench.simulate.cost import client_from_timings
    from nanovllm_bench.simulate.run import client_results

    timings = tmp_path / "idle.json"
    timings.write_text(json.dumps({"long": {"prompt_tokens": 20000, "outside_server_ms": 1.2},
                                   "short": {"prompt_tokens": 200, "outside_server_ms": 0.8}}))  # fmt: skip
    client = client_from_timings([str(timings)])
    per_1k = 0.4 / 19.8
    assert client["client_ms_per_1k_prompt_tokens"] == pytest.approx(per_1k)
    assert client["client_ms"] == pytest.approx(0.8 - 0.2 * per_1k)
    times = TraceSimulator(small_calibration(), max_num_seqs=8, max_num_batched_tokens=128,
                           max_model_len=512).replay([TraceRequest(0.0, [5] * 100, 3)])  # fmt: skip
    plain = client_results(times, {"delivery_ms": 0.5})[0]
    seen = client_results(times, {"delivery_ms": 0.5, **client})[0]
    extra = (client["client_ms"] + 0.1 * per_1k) / 1e3
    assert seen.ttft == pytest.approx(plain.ttft + extra) and seen.latency == pytest.approx(plain.latency + extra)
    assert seen.itl == plain.itl
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="no prompt's timings"):
        client_from_timings([str(bad)])


def test_frontend_metrics_count_the_front_end_and_the_hop_between_two_scrapes(tmp_path):
    """/metrics scrapes of one server before and after a run: the intake is the run's mean front-end time plus its
    mean hop to the engine, the delivery its mean output lag."""
    from nanovllm_bench.simulate.cost import frontend_from_metrics

    def scrape(path, frontend, hop, delivery, count):
        path.write_text("".join(
            f'nanovllm:{name}_sum{{model_name="m"}} {total}\nnanovllm:{name}_count{{model_name="m"}} {count}\n'
            for name, total in (("request_frontend_time_seconds", frontend), ("request_intake_time_seconds", hop),
                                ("output_delivery_lag_seconds", delivery))
        ))  # fmt: skip

    scrape(tmp_path / "before.txt", 0.5, 0.5, 0.5, 100)
    scrape(tmp_path / "after.txt", 0.5 + 0.2, 0.5 + 0.05, 0.5 + 0.03, 200)  # the run: 100 requests
    frontend = frontend_from_metrics([str(tmp_path / "after.txt"), str(tmp_path / "before.txt")])
    assert frontend["frontend_ms"] == pytest.approx(2.0) and frontend["hop_ms"] == pytest.approx(0.5)
    assert frontend["intake_ms"] == pytest.approx(2.5) and frontend["delivery_ms"] == pytest.approx(0.3)


def test_request_timelines_and_frontend_metrics_are_one_or_the_other(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "x"}\n')
    assert cli_main(["simulate", "--calibrate", "b.json", "--out", "c.json", "--request-timelines", str(bad),
                     "--frontend-metrics", "m.txt"]) == 2  # fmt: skip
    assert "--frontend-metrics or --request-timelines" in capsys.readouterr().err
    from nanovllm_bench.simulate.cost import frontend_from_timelines

    with pytest.raises(ConfigError, match="bad.jsonl:1: not a request's timeline"):
        frontend_from_timelines([str(bad)])
