"""The held-out workloads of benchmarks/policies.py (``held-out-agents``, then ``held-out-reasoning``, written
before the refit after the first was read, then ``held-out-classify``, after the second was): traces fitted on
nothing.

``held-out-agents``' trace is deterministic and has the intended shape (multi-turn agent sessions whose
prompts repeat the earlier turns token for token, 1-4k tokens, short outputs, bursts on one context);
``policies.py`` serves it and ``simulate_policies.py`` simulates it with no change of theirs; no calibration can
be fitted on it (``calibrate.py`` and ``policies.py --step-records`` refuse it). ``held-out-reasoning``: one
shared instruction, questions of 32-768 tokens, outputs of 256-4,096 tokens spread evenly in their logarithm.
CPU only: nothing here runs a model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from nanovllm_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
WORKLOAD = "held-out-agents"
REASONING = "held-out-reasoning"
CLASSIFY = "held-out-classify"
EXTRACT = "held-out-extract"
RAG = "held-out-rag"


@pytest.fixture(scope="module")
def policies():
    return load_script(BENCHMARKS / "policies.py")


@pytest.fixture(scope="module")
def trace(policies) -> list[dict]:
    return policies.agent_sessions()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_written_as_read(writer, rows: list[dict], tmp_path: Path, num_requests: int | None = None) -> None:
    """The trace file ``writer`` writes is ``rows``, as ``nanovllm bench serve`` reads it."""
    from nanovllm_bench.serve import read_trace

    path = tmp_path / "trace.jsonl"
    writer(path) if num_requests is None else writer(path, num_requests)
    assert [(r.prompt, r.max_tokens) for r in read_trace(str(path), 0, 10000)] == [
        (r["prompt"], r["max_tokens"]) for r in rows
    ]


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_it_is_a_held_out_trace_workload_of_policies_py(policies) -> None:
    spec = policies.WORKLOADS[WORKLOAD]
    assert WORKLOAD in policies.HELD_OUT and spec["held_out"] and spec["trace"] == "held-out-agents.jsonl"
    assert spec["flags"] == ["--dataset", "TRACE"] and policies.TRACE_WRITERS[WORKLOAD] is policies.write_agents_trace
    assert "fitted on nothing" in policies.__doc__


def test_the_trace_is_deterministic_for_its_seed(policies, trace, tmp_path: Path) -> None:
    assert policies.agent_sessions() == trace
    assert policies.agent_sessions(40) == trace[:40]  # a short trace is the full one's start
    assert policies.agent_sessions(40, seed=1) != trace[:40]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    policies.write_agents_trace(a)
    policies.write_agents_trace(b)
    assert a.read_bytes() == b.read_bytes()


def test_bench_serve_and_simulate_read_the_written_trace(policies, trace, tmp_path: Path) -> None:
    from nanovllm_bench.serve import read_trace

    path = tmp_path / policies.AGENTS_TRACE
    policies.write_agents_trace(path)
    requests = read_trace(str(path), 0, 10000)
    assert [(r.prompt, r.max_tokens) for r in requests] == [(r["prompt"], r["max_tokens"]) for r in trace]
    assert all(r.arrival is None and r.priority is None for r in requests)  # policies.py sets rates and classes


def test_the_trace_has_the_intended_shape(policies, trace) -> None:
    lengths = sorted(len(r["prompt"]) for r in trace)
    assert len(trace) == policies.WORKLOADS[WORKLOAD]["prompts"] == 1000
    assert policies.AGENT_SYSTEM[0] + policies.AGENT_TASK[0] <= lengths[0] and lengths[-1] <= policies.AGENT_CONTEXT
    assert 1500 <= lengths[len(lengths) // 2] <= 3500  # 1-4k tokens, most of them well inside
    assert all(16 <= r["max_tokens"] <= 128 for r in trace)
    assert all(max(r["prompt"]) < 10000 for r in trace)  # bench serve's default vocabulary: no id is wrapped
    # every prompt opens with one of the agents' system prompts, which their sessions share
    assert len({tuple(r["prompt"][: policies.AGENT_SYSTEM[0]]) for r in trace}) == policies.AGENT_KINDS

    turns: dict[tuple[int, int], list[int]] = defaultdict(list)  # (session, turn): the rows, in trace order
    for i, r in enumerate(trace):
        turns[r["session"], r["turn"]].append(i)
    branch = policies.AGENT_BRANCH[1]
    bursts = [rows for rows in turns.values() if len(rows) > 1]
    assert 0.15 <= len(bursts) / len(turns) <= 0.35
    for rows in bursts:  # consecutive requests on one context, each with a short suffix of its own
        assert rows == list(range(rows[0], rows[0] + len(rows))) and len(rows) <= policies.AGENT_BURST_SIZE[1]
        prompts = [trace[i]["prompt"] for i in rows]
        assert len({tuple(p) for p in prompts}) == len(prompts)
        assert all(common_prefix(prompts[0], p) >= len(p) - branch for p in prompts)
    for (session, turn), rows in turns.items():  # a turn repeats the previous one's context token for token
        if turn == 0:
            continue
        before = turns[session, turn - 1]
        assert max(before) < min(rows)
        previous = trace[before[0]]["prompt"]
        context = len(previous) - (branch if len(before) > 1 else 0)
        assert all(common_prefix(previous, trace[i]["prompt"]) >= context for i in rows)
        assert all(len(trace[i]["prompt"]) > len(previous) for i in rows if len(before) == 1)

    # most prompt tokens are prefix-cache hits (whole 256-token blocks an earlier prompt of the session holds)
    seen: dict[int, list[list[int]]] = defaultdict(list)
    hits = 0
    for r in trace:
        best = max((common_prefix(p, r["prompt"]) for p in seen[r["session"]]), default=0)
        hits += best // 256 * 256
        seen[r["session"]].append(r["prompt"])
    assert hits / sum(lengths) > 0.6
    assert 60 <= len(seen) <= 250  # sessions of several turns each


def test_policies_dry_run_serves_it(tmp_path: Path) -> None:
    proc = run_script(
        BENCHMARKS / "policies.py", "--dry-run", "--workloads", WORKLOAD, "--results-dir", str(tmp_path / "r")
    )
    assert proc.returncode == 0, proc.stderr
    clients = [line for line in proc.stdout.splitlines() if line.startswith("nanovllm bench serve")]
    assert len(clients) == 5  # fifo's saturation and loads, mixed's loads, priority's idle run and loads
    assert all(f"--dataset {tmp_path}/r/policies/held-out-agents.jsonl" in line for line in clients)
    assert "--max-model-len 8192" in proc.stdout and not (tmp_path / "r").exists()


@pytest.mark.parametrize("workloads", [WORKLOAD, "long-docs,held-out-agents", None])
def test_its_steps_are_never_recorded_for_a_calibration(workloads: str | None, tmp_path: Path) -> None:
    chosen = ["--workloads", workloads] if workloads else []  # None: every workload, the default
    proc = run_script(
        BENCHMARKS / "policies.py", "--dry-run", "--step-records", *chosen, "--results-dir", str(tmp_path)
    )
    assert proc.returncode != 0 and proc.stdout == ""
    every = "held-out-agents, held-out-reasoning, held-out-classify, held-out-extract, held-out-rag"
    held = "held-out-agents" if workloads else every
    assert proc.stderr.strip().splitlines() == [
        f"error: --step-records with {held}: a held-out workload is fitted on nothing; leave it out"
    ]


def test_calibrate_refuses_it(tmp_path: Path, capsys) -> None:
    script = load_script(BENCHMARKS / "calibrate.py")
    assert script.main(["--dry-run", "--from-servers"]) == 0  # long documents, as shipped
    assert "--workloads long-docs " in capsys.readouterr().out
    script.SERVED_WORKLOADS = ("long-docs", WORKLOAD)
    with pytest.raises(
        SystemExit, match="^error: calibrate.py --from-servers with held-out-agents: .*fitted on nothing"
    ):
        script.main(["--dry-run", "--from-servers"])
    steps = tmp_path / "policies"
    steps.mkdir()
    script.check_served(steps)  # no summary: nothing to refuse
    (steps / "summary.json").write_text(json.dumps({"rows": [{"workload": "long-docs"}]}))
    script.check_served(steps)
    (steps / "summary.json").write_text(json.dumps({"rows": [{"workload": "long-docs"}, {"workload": WORKLOAD}]}))
    with pytest.raises(SystemExit, match="with held-out-agents"):
        script.check_served(steps)


def test_simulate_runs_a_slice_of_it_with_the_shipped_calibration(policies, tmp_path: Path) -> None:
    from nanovllm_bench.simulate.run import DEFAULT_CALIBRATION

    from nanovllm_core.cli import main as cli_main

    path = tmp_path / policies.AGENTS_TRACE
    policies.write_agents_trace(path, 80)
    unshared = tmp_path / "same-lengths.jsonl"  # the same lengths, every prompt fresh ids: no prefix to reuse
    rows = policies.agent_sessions(80)
    unshared.write_text("".join(json.dumps({"prompt_len": len(r["prompt"]), "max_tokens": r["max_tokens"]}) + "\n"
                                for r in rows))  # fmt: skip

    def simulate(trace: Path, *scheduler: str) -> dict:
        out = tmp_path / "simulated.json"
        args = ["--dataset", str(trace), "--num-prompts", "80", "--client-processes", "4", "--priorities", "0,1"]
        assert cli_main(["simulate", *args, "--request-rate", "20", *scheduler, "--result-file", str(out)]) == 0
        return json.loads(out.read_text())

    for scheduler in ([], ["--scheduler", "mixed", "--max-num-batched-tokens", "2048"]):
        result = simulate(path, *scheduler)
        assert result["completed"] == 80 and result["failed"] == 0 and result["calibration"] == DEFAULT_CALIBRATION
        assert result["total_input_tokens"] == sum(len(r["prompt"]) for r in rows)
        # the prefix sharing is real: the engine's prefix cache serves the repeated contexts, so the first tokens
        # come much sooner than for prompts of the same lengths that share nothing
        assert result["mean_ttft_ms"] < 0.75 * simulate(unshared, *scheduler)["mean_ttft_ms"]


def test_simulate_policies_reports_it_apart(policies, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    policies.write_agents_trace(folder / policies.AGENTS_TRACE, 30)  # the first 30 of the trace the servers read
    fixture = {"request_throughput": 5.0, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_itl_ms": 2.0}
    runs = [{"request_rate": rate, "num_prompts": 30, "p99_itl_ms": 4.0, **fixture} for rate in (3.0, 6.0)]
    (folder / f"fifo_{WORKLOAD}.json").write_text(json.dumps({"runs": runs}))
    summary = {
        "step_tokens": 2048,
        "saturation_req_per_s": {WORKLOAD: 10.0},
        "rows": [{"policy": "fifo", "workload": WORKLOAD}],
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    script = load_script(BENCHMARKS / "simulate_policies.py")
    assert script.main(["--results-dir", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert f"| {WORKLOAD}, 30%, 3 req/s | `fifo` |" in out
    assert f"held out (fitted on nothing): {WORKLOAD}, " in out and " of 10 cells within the goal" in out
    result = json.loads((tmp_path / "rows.json").read_text())
    assert result["held_out"][WORKLOAD]["cells"] == 10 and all(r["held_out"] for r in result["rows"])
    assert all(f"--dataset {folder}/held-out-agents.jsonl" in r["command"] for r in result["rows"])


# held-out-reasoning


def test_the_reasoning_trace_is_deterministic_and_has_the_intended_shape(policies, tmp_path: Path) -> None:
    trace = policies.reasoning_requests()
    assert policies.reasoning_requests() == trace and policies.reasoning_requests(20) == trace[:20]
    assert policies.reasoning_requests(20, seed=1) != trace[:20]
    shared = policies.REASONING_INSTRUCTION
    assert len({tuple(r["prompt"][:shared]) for r in trace}) == 1  # one instruction, every request
    questions = [len(r["prompt"]) - shared for r in trace]
    assert min(questions) >= policies.REASONING_QUESTION[0] and max(questions) <= policies.REASONING_QUESTION[1]
    outputs = sorted(r["max_tokens"] for r in trace)
    low, high = policies.REASONING_OUTPUT
    assert low <= outputs[0] and outputs[-1] <= high
    # uniform in the logarithm: each quarter of log(tokens) holds about a quarter of the requests
    quarters = [0] * 4
    for n in outputs:
        quarters[min(3, int(4 * (math.log(n) - math.log(low)) / (math.log(high) - math.log(low))))] += 1
    assert all(50 <= q <= 100 for q in quarters), quarters
    assert all(max(r["prompt"]) < 10000 for r in trace)  # bench serve's default vocabulary
    assert max(len(r["prompt"]) + r["max_tokens"] for r in trace) <= policies.MAX_MODEL_LEN

    assert_written_as_read(policies.write_reasoning_trace, trace, tmp_path)


# held-out-classify


def test_the_classify_trace_is_deterministic_and_has_the_intended_shape(policies, tmp_path: Path) -> None:
    trace = policies.classify_requests()
    assert policies.classify_requests() == trace and policies.classify_requests(20) == trace[:20]
    assert policies.classify_requests(20, seed=1) != trace[:20]
    # four tasks: every prompt opens with one of four instructions, each shared by about a quarter of the requests
    by_task: dict[tuple[int, ...], list[dict]] = defaultdict(list)
    low, high = policies.CLASSIFY_INSTRUCTION
    for row in trace:
        task = next(i for i in trace if common_prefix(i["prompt"], row["prompt"]) >= low)  # the first of its task
        by_task[tuple(task["prompt"][:low])].append(row)
    assert len(by_task) == policies.CLASSIFY_TASKS
    assert all(400 <= len(rows) <= 600 for rows in by_task.values()), [len(r) for r in by_task.values()]
    for rows in by_task.values():
        shared = min(common_prefix(rows[0]["prompt"], r["prompt"]) for r in rows[1:])
        assert low <= shared <= high  # the instruction (an input may open with its next token by chance)
        inputs = [len(r["prompt"]) - shared for r in rows]
        assert min(inputs) >= policies.CLASSIFY_INPUT[0] - 2 and max(inputs) <= policies.CLASSIFY_INPUT[1]
    outputs = [r["max_tokens"] for r in trace]
    assert set(outputs) == set(range(policies.CLASSIFY_OUTPUT[0], policies.CLASSIFY_OUTPUT[1] + 1))
    assert all(max(r["prompt"]) < 10000 for r in trace)
    assert max(len(r["prompt"]) + r["max_tokens"] for r in trace) <= policies.MAX_MODEL_LEN

    assert_written_as_read(policies.write_classify_trace, trace[:50], tmp_path, 50)


# held-out-extract


def test_the_extract_trace_is_deterministic_and_has_the_intended_shape(policies, tmp_path: Path) -> None:
    trace = policies.extract_requests()
    assert len(trace) == 1500 and policies.extract_requests(20) == trace[:20]
    assert policies.extract_requests(20, seed=1) != trace[:20]
    # three schemas: every prompt opens with one of three instructions, each shared by about a third of the requests
    low, high = policies.EXTRACT_INSTRUCTION
    by_schema: dict[tuple[int, ...], list[dict]] = defaultdict(list)
    for row in trace:
        by_schema[tuple(row["prompt"][:low])].append(row)
    assert len(by_schema) == policies.EXTRACT_SCHEMAS
    assert all(400 <= len(rows) <= 600 for rows in by_schema.values()), [len(r) for r in by_schema.values()]
    for rows in by_schema.values():
        shared = min(common_prefix(rows[0]["prompt"], r["prompt"]) for r in rows[1:])
        assert low <= shared <= high
        documents = [len(r["prompt"]) - shared for r in rows]
        assert min(documents) >= policies.EXTRACT_DOCUMENT[0] - 2 and max(documents) <= policies.EXTRACT_DOCUMENT[1]
    outputs = [r["max_tokens"] for r in trace]
    assert min(outputs) == policies.EXTRACT_OUTPUT[0] and max(outputs) == policies.EXTRACT_OUTPUT[1]
    assert 80 <= sum(outputs) / len(outputs) <= 104  # uniform over 24-160
    assert all(max(r["prompt"]) < 10000 for r in trace)
    assert max(len(r["prompt"]) + r["max_tokens"] for r in trace) <= policies.MAX_MODEL_LEN

    assert_written_as_read(policies.write_extract_trace, trace[:50], tmp_path, 50)


# held-out-rag


def test_the_rag_trace_is_deterministic_and_has_the_intended_shape(policies, tmp_path: Path) -> None:
    trace = policies.rag_requests()
    assert len(trace) == 600 and policies.rag_requests(20) == trace[:20]
    assert policies.rag_requests(20, seed=1) != trace[:20]
    # one system prompt opens every request; passages of the pool follow, the popular ones first more often
    system = min(common_prefix(trace[0]["prompt"], r["prompt"]) for r in trace[1:])
    assert policies.RAG_SYSTEM[0] <= system <= policies.RAG_SYSTEM[1] + policies.RAG_PASSAGE[1]
    firsts = [tuple(r["prompt"][system : system + policies.RAG_PASSAGE[0]]) for r in trace]
    shared = max(firsts.count(f) for f in set(firsts))
    assert 0.1 * len(trace) <= shared <= 0.3 * len(trace)  # the most popular passage leads a sixth or so
    lengths = [len(r["prompt"]) for r in trace]
    assert 1000 <= min(lengths) and max(lengths) <= 6464 and 2500 <= sum(lengths) / len(lengths) <= 3300
    outputs = [r["max_tokens"] for r in trace]
    assert min(outputs) == policies.RAG_OUTPUT[0] and max(outputs) == policies.RAG_OUTPUT[1]
    assert all(max(r["prompt"]) < 10000 for r in trace)
    assert max(len(r["prompt"]) + r["max_tokens"] for r in trace) <= policies.MAX_MODEL_LEN

    assert_written_as_read(policies.write_rag_trace, trace[:30], tmp_path, 30)


# held-out-reasoning, held-out-classify, held-out-extract and held-out-rag


@pytest.mark.parametrize(("workload", "prompts"), [(REASONING, 300), (CLASSIFY, 2000), (EXTRACT, 1500), (RAG, 600)])
def test_it_is_a_held_out_trace_workload(policies, workload: str, prompts: int) -> None:
    spec = policies.WORKLOADS[workload]
    assert workload in policies.HELD_OUT and spec["held_out"] and spec["trace"] == f"{workload}.jsonl"
    assert policies.TRACE_WRITERS[workload].__name__ == f"write_{workload.removeprefix('held-out-')}_trace"
    assert spec["prompts"] == spec["saturation_prompts"] == prompts


@pytest.mark.parametrize(("workload", "prompts"), [(REASONING, 300), (CLASSIFY, 2000), (EXTRACT, 1500), (RAG, 600)])
def test_policies_serves_it_and_never_records_its_steps(workload: str, prompts: int, tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BENCHMARKS / "policies.py"), "--dry-run", "--workloads", workload,
                               "--results-dir", str(tmp_path / "r"), *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)  # fmt: skip

    served = run("--idle-prompts", "0")
    assert served.returncode == 0, served.stderr
    clients = [line for line in served.stdout.splitlines() if line.startswith("nanovllm bench serve")]
    assert clients and all(f"--dataset {tmp_path}/r/policies/{workload}.jsonl" in c for c in clients)
    assert all(f"--num-prompts {prompts}" in c for c in clients)
    refused = run("--step-records")
    assert refused.returncode != 0 and f"--step-records with {workload}" in refused.stderr


@pytest.mark.parametrize(("workload", "requests", "rate"), [(REASONING, 24, "4"), (CLASSIFY, 60, "50"), (RAG, 20, "5")])
def test_simulate_reads_a_slice_of_it(policies, workload: str, requests: int, rate: str, tmp_path: Path) -> None:
    from nanovllm_core.cli import main as cli_main

    path = tmp_path / "trace.jsonl"
    policies.TRACE_WRITERS[workload](path, requests)
    out = tmp_path / "simulated.json"
    args = ["--dataset", str(path), "--num-prompts", str(requests), "--request-rate", rate, "--result-file", str(out)]
    assert cli_main(["simulate", *args]) == 0
    result = json.loads(out.read_text())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert result["completed"] == requests and result["total_output_tokens"] == sum(r["max_tokens"] for r in rows)
