"""The plugin adds ``nanovllm bench`` (with its ``serve`` mode) and ``nanovllm simulate`` through the command hook:
registered by this distribution, listed by ``nanovllm --help``, their flags parsed as when they were built in
(the engine's flags, vLLM's spellings and YAML ``--config``, ``--demo``), and each mode run by its function."""

from __future__ import annotations

import subprocess
import sys

import nanovllm_bench.offline
import nanovllm_bench.serve
import pytest
from nanovllm_bench.commands import BenchCommand, SimulateCommand

from nanovllm_core import Command
from nanovllm_core.cli import build_parser, cli_overrides, main, parse_command_line
from nanovllm_core.plugins import PROVIDERS, get_registry


def test_the_plugin_registers_both_commands() -> None:
    registry = get_registry()
    for name, cls in (("bench", BenchCommand), ("simulate", SimulateCommand)):
        registration = registry.registrations["command"][name]
        assert registration.obj is cls and issubclass(cls, Command)
        assert registration.distribution == "nanovllm-bench" == PROVIDERS["command"][name]
    assert not [b for b in registry.broken if b.distribution == "nanovllm-bench"], registry.broken


def test_nanovllm_help_lists_them() -> None:
    out = subprocess.run([sys.executable, "-m", "nanovllm_core.cli", "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "throughput benchmark (nano-vllm's workload)" in out.stdout and "judge a scheduler policy" in out.stdout
    assert "Not installed" not in out.stdout


def test_bench_keeps_its_flags_and_the_engines() -> None:
    bench = build_parser().parse_args(["bench", "--max-num-seqs", "8", "--attention", "torch", "--num-seqs", "3"])
    assert (bench.max_num_seqs, bench.plugin_attention, bench.num_seqs, bench.bench_mode) == (8, "torch", 3, None)
    assert isinstance(bench.func.__self__, BenchCommand)
    assert build_parser().parse_args(["bench", "--config", "x.toml"]).config == "x.toml"
    args = build_parser().parse_args(["bench", "--block-size", "16", "--scheduling-policy", "priority"])
    assert cli_overrides(args) == {"kvcache_block_size": 16, "plugins": {"scheduler": "priority"}}  # vLLM's spellings
    assert build_parser().parse_args(["bench", "--demo"]).demo is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--demo", "--model", "/m"])


def test_bench_serve_is_a_mode_of_bench() -> None:
    args = build_parser().parse_args(["bench", "serve", "--request-rate", "4", "--dataset", "sharegpt-synth"])
    assert args.bench_mode == "serve" and args.request_rate == 4 and args.dataset == "sharegpt-synth"
    assert isinstance(args.func.__self__, BenchCommand)


def test_bench_reads_vllms_yaml_config(tmp_path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text("max-num-seqs: 8\nblock-size: 32\n")
    args = parse_command_line(["bench", "--config", str(path), "--max-num-seqs", "4"])
    assert cli_overrides(args) == {"max_num_seqs": 4, "kvcache_block_size": 32}


def test_each_mode_runs_its_function(monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(nanovllm_bench.offline, "run_bench", lambda a, overrides: ran.append(("bench", overrides)) or 0)
    monkeypatch.setattr(nanovllm_bench.serve, "run_bench_serve", lambda a: ran.append(("serve", a.num_prompts)) or 3)
    assert main(["bench", "--max-num-seqs", "2"]) == 0
    assert main(["bench", "serve", "--num-prompts", "5"]) == 3
    assert ran == [("bench", {"max_num_seqs": 2}), ("serve", 5)]


def test_simulate_parses_its_flags() -> None:
    args = build_parser().parse_args(["simulate", "--scheduler", "priority", "--scheduler", "fifo"])
    assert isinstance(args.func.__self__, SimulateCommand) and args.scheduler == ["priority", "fifo"]
