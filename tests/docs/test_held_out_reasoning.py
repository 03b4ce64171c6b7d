"""The second held-out workload of benchmarks/policies.py (``held-out-reasoning``): long answers to short questions,
written before any calibration refitted after ``held-out-agents`` was read, and fitted on nothing.

Its trace is deterministic and has the intended shape (one shared instruction, questions of 32-768 tokens, outputs
of 256-4,096 tokens spread evenly in their logarithm); ``policies.py`` serves it and ``nanovllm simulate`` reads
it with no change of theirs; nothing fits a calibration on it. CPU only: nothing here runs a model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from nanovllm_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
WORKLOAD = "held-out-reasoning"


@pytest.fixture(scope="module")
def policies():
    return load_script(BENCHMARKS / "policies.py")


def test_it_is_a_held_out_trace_workload(policies) -> None:
    spec = policies.WORKLOADS[WORKLOAD]
    assert WORKLOAD in policies.HELD_OUT and spec["held_out"] and spec["trace"] == "held-out-reasoning.jsonl"
    assert policies.TRACE_WRITERS[WORKLOAD] is policies.write_reasoning_trace
    assert spec["prompts"] == spec["saturation_prompts"] == 300


def test_the_trace_is_deterministic_and_has_the_intended_shape(policies, tmp_path: Path) -> None:
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

    from nanovllm_bench.serve import read_trace

    path = tmp_path / "trace.jsonl"
    policies.write_reasoning_trace(path)
    assert [(r.prompt, r.max_tokens) for r in read_trace(str(path), 0, 10000)] == [
        (r["prompt"], r["max_tokens"]) for r in trace
    ]


def test_policies_serves_it_and_never_records_its_steps(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BENCHMARKS / "policies.py"), "--dry-run", "--workloads", WORKLOAD,
                               "--results-dir", str(tmp_path / "r"), *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)  # fmt: skip

    served = run("--idle-prompts", "0")
    assert served.returncode == 0, served.stderr
    clients = [line for line in served.stdout.splitlines() if line.startswith("nanovllm bench serve")]
    assert clients and all(f"--dataset {tmp_path}/r/policies/held-out-reasoning.jsonl" in c for c in clients)
    assert all("--num-prompts 300" in c for c in clients)
    refused = run("--step-records")
    assert refused.returncode != 0 and "--step-records with held-out-reasoning" in refused.stderr


def test_simulate_reads_a_slice_of_it(policies, tmp_path: Path) -> None:
    from nanovllm_core.cli import main as cli_main

    path = tmp_path / "trace.jsonl"
    policies.write_reasoning_trace(path, 24)
    out = tmp_path / "simulated.json"
    args = ["--dataset", str(path), "--num-prompts", "24", "--request-rate", "4", "--result-file", str(out)]
    assert cli_main(["simulate", *args]) == 0
    result = json.loads(out.read_text())
    rows = policies.reasoning_requests(24)
    assert result["completed"] == 24 and result["total_output_tokens"] == sum(r["max_tokens"] for r in rows)
