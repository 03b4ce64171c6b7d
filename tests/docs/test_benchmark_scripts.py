"""The benchmark scripts stay runnable, and so do the commands docs/performance.md quotes.

Every script in benchmarks/ answers ``--help``; the ones that run the engine's CLI also do a ``--dry-run``, which
parses every command they would run with the installed CLI's own parser. Every command in a table of
docs/performance.md names a script or a ``nanovllm`` command that exists and accepts those arguments. CPU only:
nothing here runs a model.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
from nanovllm_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
DRY_RUN = {"offline.py", "serving.py", "policies.py", "gpu_kernels.py", "calibrate.py"}  # those that run the CLI
PERFORMANCE = ROOT / "docs" / "performance.md"


def table_commands() -> list[str]:
    """The commands in docs/performance.md's table rows (backticked, starting with `python benchmarks/` or
    `nanovllm `)."""
    commands = []
    for line in PERFORMANCE.read_text().splitlines():
        if line.startswith("|"):
            commands += [c for c in re.findall(r"`([^`]+)`", line) if c.startswith(("python benchmarks/", "nanovllm "))]
    return sorted(set(commands))


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def load(script: Path) -> types.ModuleType:
    return load_script(script)


def exited(code: object, stdout: str, stderr: str) -> subprocess.CompletedProcess:
    """What the process would end with, had ``SystemExit(code)`` reached the interpreter: its message, when not a
    number, on stderr and the status 1."""
    if code is None or isinstance(code, int):
        return subprocess.CompletedProcess([], code or 0, stdout, stderr)
    return subprocess.CompletedProcess([], 1, stdout, f"{stderr}{code}\n")


def run_main(capsys: pytest.CaptureFixture, script: Path, *args: str) -> subprocess.CompletedProcess:
    """``run_script`` without starting an interpreter (each would import torch and the engine anew): the script's
    ``main`` in this process. That each script runs as ``python benchmarks/NAME.py``: the ``--help`` tests."""
    module = load(script)
    capsys.readouterr()
    try:
        code = module.main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    return exited(code, *capsys.readouterr())


# Runs each script as `python SCRIPT --help` would, all in one interpreter (each one's start imports torch anew): only
# the script's folder on sys.path before the installed packages, its sibling modules imported afresh, run as
# __main__. Prints {script: [the SystemExit code, stdout, stderr]}.
HELP_EACH = """
import contextlib, io, json, runpy, sys, traceback
from pathlib import Path

scripts, installed, answers = sys.argv[1:], sys.path[1:], {}
for script in scripts:
    folder = str(Path(script).parent)
    sys.path[:], sys.argv = [folder, *installed], [script, "--help"]
    for name, module in list(sys.modules.items()):
        if str(Path(getattr(module, "__file__", None) or "").parent) == folder:
            del sys.modules[name]
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:
            traceback.print_exc()
            code = 1
    answers[script] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict[str, subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, "-c", HELP_EACH, *map(str, SCRIPTS)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {Path(script).name: exited(*answer) for script, answer in json.loads(proc.stdout).items()}


def test_the_benchmarks_folder_has_its_scripts_and_readme() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"offline.py", "serving.py", "policies.py", "gpu_kernels.py", "plot.py"} <= names, names
    readme = (BENCHMARKS / "README.md").read_text()
    missing = [name for name in names if f"`{name}`" not in readme]
    assert not missing, f"benchmarks/README.md does not describe {missing}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help(script: Path, help_answers: dict[str, subprocess.CompletedProcess]) -> None:
    proc = help_answers[script.name]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
    if script.name in DRY_RUN:
        assert "--dry-run" in proc.stdout and "--results-dir" in proc.stdout


@pytest.mark.parametrize("name", sorted(DRY_RUN))
def test_dry_run_prints_the_commands_and_writes_nothing(name: str, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    proc = run_main(capsys, BENCHMARKS / name, "--dry-run", "--results-dir", str(results))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("nanovllm ", "python "))]
    assert lines, proc.stdout
    assert all(str(results) in line for line in lines if "--json" in line or "--result-file" in line)
    assert not results.exists(), "a dry run made the results folder"


def test_a_flag_the_cli_does_not_have_stops_the_script_before_anything_runs(tmp_path: Path, capsys) -> None:
    proc = run_main(
        capsys,
        BENCHMARKS / "offline.py",
        "--dry-run",
        "--workloads",
        "0.6b-bf16",
        "--bench-args",
        "--no-such-flag 1",
        "--results-dir",
        str(tmp_path),
    )
    assert proc.returncode != 0
    assert "does not parse with the installed nanovllm" in proc.stderr and "--no-such-flag" in proc.stderr


def test_a_bad_selection_is_named_with_the_choices(tmp_path: Path, capsys) -> None:
    proc = run_main(
        capsys, BENCHMARKS / "policies.py", "--dry-run", "--policies", "fifo,lifo", "--results-dir", str(tmp_path)
    )
    assert proc.returncode != 0
    assert "--policies 'fifo,lifo': choose from fifo, mixed, priority" in proc.stderr


def test_the_long_documents_trace_is_what_both_bench_serve_and_simulate_read(tmp_path: Path, capsys) -> None:
    from nanovllm_bench.serve import read_trace

    policies = load(BENCHMARKS / "policies.py")
    trace = tmp_path / policies.LONG_DOCS_TRACE
    policies.write_long_documents_trace(trace)
    requests = read_trace(str(trace), 0, 10000)
    documents = [r for r in requests if len(r.prompt) >= 8192]
    assert len(requests) == 1000 and len(documents) == 50
    assert all(len(r.prompt) <= 32768 and 128 <= r.max_tokens <= 512 for r in documents)
    proc = run_main(
        capsys, BENCHMARKS / "policies.py", "--dry-run", "--workloads", "long-docs", "--results-dir", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "--max-model-len 40960" in proc.stdout and f"--dataset {tmp_path}/policies/long-docs.jsonl" in proc.stdout


def test_simulate_policies_simulates_each_measured_run(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    measured = {"request_throughput": 5.0, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_itl_ms": 2.0}
    runs = [{"request_rate": rate, "num_prompts": 6, "p99_itl_ms": 4.0, **measured} for rate in (3.0, 6.0)]
    (folder / "fifo_nano.json").write_text(json.dumps({"runs": runs}))
    summary = {
        "step_tokens": 2048,
        "saturation_req_per_s": {"nano": 10.0},
        "rows": [{"policy": "fifo", "workload": "nano"}],
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    script = load(BENCHMARKS / "simulate_policies.py")
    assert script.main(["--results-dir", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| nano, 30%, 3 req/s | `fifo` |" in out and "| nano, 60%, 6 req/s | `fifo` |" in out
    assert "of 10 cells within the goal" in out
    assert "the policies' order on each p99 (measured figures more than 10% apart): the same in 0 of 0 pairs" in out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["request_rate"] for r in rows] == [3.0, 6.0]
    assert all("--warm-prefix-cache 6" in r["command"] for r in rows)  # fifo's loads follow its all-at-once run
    assert rows[0]["simulated"]["request_throughput"] > 0
    assert not any("--cuda-graph-max-mixed-tokens" in r["command"] for r in rows)  # unrecorded: the calibration's

    (folder / "summary.json").write_text(json.dumps({**summary, "cuda_graph_max_mixed_tokens": 4096}))
    assert script.main(["--results-dir", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert all(r["command"].endswith("--cuda-graph-max-mixed-tokens 4096") for r in rows)


def test_policies_records_the_servers_graph_limit(tmp_path) -> None:
    """As ``nanovllm serve`` resolves it: a flag over a config file (TOML or vLLM's YAML) over the default."""
    from nanovllm_core.config import EngineConfig

    policies = load(BENCHMARKS / "policies.py")
    (tmp_path / "c.toml").write_text("cuda_graph_max_mixed_tokens = 3000\n")
    (tmp_path / "c.yaml").write_text("cuda-graph-max-mixed-tokens: 1500\n")
    assert policies.graph_limit("") == EngineConfig(model="m").cuda_graph_max_mixed_tokens
    assert policies.graph_limit("--enforce-eager --cuda-graph-max-mixed-tokens 1024") == 1024
    assert policies.graph_limit(f"--config {tmp_path / 'c.toml'}") == 3000
    assert policies.graph_limit(f"--config {tmp_path / 'c.yaml'}") == 1500
    assert policies.graph_limit(f"--config {tmp_path / 'c.toml'} --cuda-graph-max-mixed-tokens 512") == 512


def test_simulate_policies_checks_the_policies_order_on_each_tail() -> None:
    """Two policies at one workload and rate whose measured p99s differ by more than 10% are an order the simulator
    must keep (a simulated tie does not); closer figures, other rates and other workloads are not compared."""
    script = load(BENCHMARKS / "simulate_policies.py")

    def row(policy: str, rate: float, measured: tuple[float, float], simulated: tuple[float, float], w: str = "nano"):
        figures = {"measured": dict(zip(script.ORDERED, measured)), "simulated": dict(zip(script.ORDERED, simulated))}
        return {"policy": policy, "workload": w, "request_rate": rate, **figures}

    rows = [
        row("fifo", 3.0, (20.0, 4.0), (12.0, 3.0)),
        row("mixed", 3.0, (10.0, 4.2), (11.0, 9.0)),  # TTFT p99 kept (10 < 20, 11 < 12); ITL p99 within 10%
        row("fifo", 6.0, (30.0, 9.0), (15.0, 5.0)),
        row("mixed", 6.0, (15.0, 5.0), (15.0, 6.0)),  # TTFT p99: a simulated tie; ITL p99: the wrong way round
        row("priority", 7.0, (1.0, 1.0), (50.0, 50.0)),  # another rate: compared with nothing
        row("mixed", 3.0, (99.0, 99.0), (1.0, 1.0), w="long-docs"),  # another workload
    ]
    order = script.policy_order(rows)
    assert [(p["request_rate"], p["metric"], p["lower"], p["higher"], p["same"]) for p in order] == [
        (3.0, "p99_ttft_ms", "mixed", "fifo", True),
        (6.0, "p99_ttft_ms", "mixed", "fifo", False),
        (6.0, "p99_itl_ms", "mixed", "fifo", False),
    ]


def test_calibrate_fits_every_run_it_benches(capsys) -> None:
    script = load(BENCHMARKS / "calibrate.py")
    assert script.main(["--dry-run", "--shape", "qwen3-8b", "--kv-cache-dtype", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    benches, fit = lines[:-1], lines[-1]
    assert len(benches) == len(script.RUNS) and all("--kv-cache-dtype fp8" in line for line in benches)
    assert "--max-num-batched-tokens 2048" in benches[2] and "--max-input-len 32768" in benches[3]
    jsons = [line.split("--json ")[1] for line in benches]
    assert fit.startswith("nanovllm simulate --calibrate " + " ".join(jsons))
    assert fit.endswith("--out results/calibrate/qwen3-8b-fp8.json")
    with pytest.raises(SystemExit, match="choose from nano"):
        script.main(["--dry-run", "--runs", "long"])


def test_calibrate_from_servers_fits_the_steps_each_policy_served(capsys) -> None:
    script = load(BENCHMARKS / "calibrate.py")
    assert script.main(["--dry-run", "--from-servers", "--kv-cache-dtype", "fp8"]) == 0
    serve, idle_server, *idle_clients, stop, fit = capsys.readouterr().out.splitlines()
    assert "policies.py --workloads long-docs" in serve and "--step-records --request-timelines" in serve
    assert "--policies fifo,mixed,priority" in serve and "--engine-args '--kv-cache-dtype fp8'" in serve
    # then an idle server, timed one request at a time: the client's part and the pipe to the engine
    assert idle_server.startswith("nanovllm serve ") and idle_server.endswith(" &") and stop.startswith("(stop")
    assert "--request-timeline results/calibrate/idle_timeline.jsonl --kv-cache-dtype fp8" in idle_server
    idle = ["results/calibrate/idle_20000_200.json", "results/calibrate/idle_10000_1000.json"]
    assert len(idle_clients) == 2 and all("request_timeline.py --port 8000" in c for c in idle_clients)
    assert [c.split("--json ")[1] for c in idle_clients] == idle
    steps = [f"results/policies/steps_{p}.json" for p in ("fifo", "mixed", "priority")]
    timelines = [f"results/policies/timeline_{p}.jsonl" for p in ("fifo", "mixed", "priority")]
    assert fit == (f"nanovllm simulate --calibrate {' '.join(steps)} --out results/calibrate/qwen3-0.6b-fp8.json "
                   f"--client-timings {' '.join(idle)} --request-timelines {' '.join(timelines)}")  # fmt: skip
    assert script.main(["--dry-run", "--from-servers", "--frontend-metrics", "after.txt", "before.txt"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("--frontend-metrics after.txt before.txt")


def test_policy_map_prints_a_row_per_policy_and_load(tmp_path: Path, capsys) -> None:
    script = load(BENCHMARKS / "policy_map.py")
    script.GRID = [("nano", 0.5, ["fifo", "priority"])]
    assert script.main(["--saturation", "nano=20", "--json", str(tmp_path / "map.json")]) == 0
    out = capsys.readouterr().out
    assert "| nano-vllm, 50% | `fifo` |" in out and "| nano-vllm, 50% | `priority` |" in out
    rows = json.loads((tmp_path / "map.json").read_text())["rows"]
    assert [r["request_rate"] for r in rows] == [10.0, 10.0]
    assert "--scheduler priority --max-num-batched-tokens 2048" in rows[1]["command"]
    assert rows[0]["result"]["by_priority"]["1"]["completed"] == 256
    with pytest.raises(SystemExit, match="WORKLOAD=REQ_PER_S"):
        script.main(["--saturation", "chat=3"])


COMMANDS = table_commands()


def test_the_performance_tables_quote_commands() -> None:
    scripts = {shlex.split(c)[1] for c in COMMANDS if c.startswith("python ")}
    assert {"benchmarks/offline.py", "benchmarks/serving.py", "benchmarks/policies.py"} <= scripts, scripts


@pytest.mark.parametrize("command", COMMANDS)
def test_each_quoted_command_exists_and_parses(command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    if argv[0] == "nanovllm":
        from nanovllm_core.cli import build_parser

        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"`{command}` does not parse: {stderr.getvalue().strip()}")
        return
    script = ROOT / argv[1]
    assert script.is_file(), f"{argv[1]} does not exist"
    module = load(script)
    if script.name in DRY_RUN:  # parses the arguments and every engine command they lead to
        with contextlib.redirect_stdout(io.StringIO()):
            assert module.main([*argv[2:], "--dry-run", "--results-dir", str(tmp_path / "results")]) == 0
    else:  # a script that runs a model at once: its arguments parse
        parse = getattr(module, "parse_args", None) or (lambda a: module.build_parser().parse_args(a))
        parse(argv[2:])


def test_the_outside_harness_runs_nano_vllms_workload_through_the_public_api(tmp_path: Path) -> None:
    out = tmp_path / "nano_bench.json"
    args = ["--shape", "tiny", "--attention", "torch", "--num-seqs", "2", "--max-input-len", "100"]
    proc = run_script(BENCHMARKS / "nano_bench.py", *args, "--max-output-len", "100", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Throughput:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 200  # two requests of randint(100, 100) tokens, none stopped early
    assert result["output_tok_per_s"] == pytest.approx(200 / result["seconds"])


def served_without_a_server(policies, monkeypatch, stop_at: str | None = None) -> list[list[str]]:
    """``policies.py`` with its servers and clients stood in for: every client command it would run (returned,
    as sent), each answered with a result file of its rates; the server of policy ``stop_at`` stops the run, as a
    time limit would."""
    sent: list[list[str]] = []

    class Server:
        def __init__(self, cmd: list[str], *args: object) -> None:
            self.cmd = cmd

        def __enter__(self) -> Server:
            if stop_at is not None and stop_at in self.cmd:
                raise SystemExit("the time limit")
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def metrics(self) -> str:
            return ""

    def answer(cmd: list[str], log: Path) -> int:
        sent.append(cmd)
        rates = cmd[cmd.index("--rates") + 1].split(",")
        figures = {"request_throughput": 1.0, "median_ttft_ms": 5.0, "p99_ttft_ms": 9.0, "p99_itl_ms": 2.0}
        runs = [{"request_rate": float(r), **figures} for r in rates]
        Path(cmd[cmd.index("--result-file") + 1]).write_text(json.dumps({"runs": runs}))
        return 0

    monkeypatch.setattr(policies, "Server", Server)
    monkeypatch.setattr(policies, "run", answer)
    monkeypatch.setattr(policies, "random_checkpoint", lambda shape, dry_run=False: Path("/checkpoint"))
    return sent


def test_policies_takes_a_known_saturation_and_leaves_a_summary_after_every_policy(tmp_path: Path, monkeypatch):
    """A run cut short during its second policy (a time limit) still leaves the first policy's summary; with
    ``--saturation`` no all-at-once run is sent and the loads are fractions of the rate given."""
    policies = load(BENCHMARKS / "policies.py")
    sent = served_without_a_server(policies, monkeypatch, stop_at="mixed")
    argv = ["--workloads", "nano", "--loads", "0.5,0.9", "--policies", "fifo,mixed", "--idle-prompts", "0",
            "--saturation", "nano=40", "--results-dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit, match="the time limit"):
        policies.main(argv)
    assert [cmd[cmd.index("--rates") + 1] for cmd in sent] == ["20.0,36.0"]  # no all-at-once run
    summary = json.loads((tmp_path / "policies" / "summary.json").read_text())
    assert summary["saturation_req_per_s"] == {"nano": 40.0} and "--saturation nano=40" in summary["command"]
    assert [(r["policy"], r["load"]) for r in summary["rows"]] == [("fifo", "0.50"), ("fifo", "0.90")]
    with pytest.raises(SystemExit, match="--saturation 'nano=0': expected WORKLOAD=REQ_PER_S"):
        policies.main([*argv[:-4], "--saturation", "nano=0", "--dry-run"])


def test_policies_sends_more_requests_a_load_where_asked_and_writes_the_trace_that_long(tmp_path: Path, monkeypatch):
    """``--prompts WORKLOAD=N``: each load sends N requests, and a trace workload's trace is written N long (its
    first requests as before); a fixed trace takes no more than it holds; bad counts are one-line errors."""
    policies = load(BENCHMARKS / "policies.py")
    sent = served_without_a_server(policies, monkeypatch)
    argv = ["--workloads", "held-out-classify", "--loads", "0.5", "--policies", "fifo", "--idle-prompts", "0",
            "--saturation", "held-out-classify=800", "--results-dir", str(tmp_path)]  # fmt: skip
    assert policies.main([*argv, "--prompts", "held-out-classify=2500"]) == 0
    assert [cmd[cmd.index("--num-prompts") + 1] for cmd in sent] == ["2500"]
    trace = (tmp_path / "policies" / "held-out-classify.jsonl").read_text().splitlines()
    assert len(trace) == 2500
    assert [json.loads(line) for line in trace[:2000]] == policies.classify_requests(2000)
    for bad, message in (
        ("held-out-classify=0", "expected WORKLOAD=N"),
        ("chat=10", "expected WORKLOAD=N"),
        ("long-docs=5000", "long-docs's trace holds 1000 requests"),
    ):
        with pytest.raises(SystemExit, match=message):
            policies.main([*argv, "--prompts", bad, "--dry-run"])


def test_frontend_queue_measures_a_real_front_end_and_simulates_it_both_ways(tmp_path: Path) -> None:
    """The front-end against the scripted engine: its idle CPU figures make the calibrations, the load is measured,
    then simulated with the fixed and the queued front-end (small: the figures are docs/evaluating-a-scheduler.md's)."""
    out = run_script(BENCHMARKS / "frontend_queue.py", "--loads", "0.5", "--num-prompts", "80", "--probe-requests",
                     "32", "--results-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "frontend_queue" / "summary.json").read_text())
    cpu = summary["idle"]["frontend_cpu"]  # from so few requests its figures are noise, not checked
    assert cpu["requests"] == 32 and len(cpu["bursts"]) == 3
    (row,) = summary["rows"]
    assert row["load"] == 0.5 and row["rate"] > 0 and row["frontend_gc"]["collections"] >= 0
    for kind in ("measured", "fixed", "queued"):
        assert row[kind]["request_throughput"] > 0 and row[kind]["p99_ttft_ms"] > 0, kind
    queued = json.loads((tmp_path / "frontend_queue" / "calibration_queued.json").read_text())["frontend"]
    fixed = json.loads((tmp_path / "frontend_queue" / "calibration_fixed.json").read_text())["frontend"]
    assert "output_cpu_ms_per_step" in queued and "output_cpu_ms_per_token" not in fixed
    # the engine's gap between two steps, from the requests alone: the same in both, never below nothing
    gaps = {json.loads((tmp_path / "frontend_queue" / f"calibration_{k}.json").read_text())["host_gap_ms"]
            for k in ("fixed", "queued")}  # fmt: skip
    assert len(gaps) == 1 and cpu["alone"]["ms_per_step"] > 2.0 and gaps == {cpu["alone"]["ms_per_step"] - 2.0}
    assert "front-end busy" in out.stdout
