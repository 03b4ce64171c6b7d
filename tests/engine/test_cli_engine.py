"""The ``nanovllm`` command with the installed plugins and a tiny checkpoint: ``plugins`` lists them (and marks
a conflict), ``generate`` runs (the parser, ``config`` and the reference without them: unit/test_cli.py)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanovllm_core import PLUGIN_API_VERSION, hookimpl, register_plugin, unregister_plugin
from nanovllm_core.cli import main


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- nanovllm plugins -------------------------------------------------------------------------------


def test_plugins_lists_kind_name_distribution_version_module(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "plugins")
    lines = out.splitlines()
    assert lines[0].split() == ["kind", "name", "distribution", "version", "module"]
    rows = {tuple(line.lstrip("* ").split()[:2]): line for line in lines[1:] if line.strip()}
    fifo = rows[("scheduler", "fifo")]
    assert fifo.startswith("*") and fifo.split()[1:] == [
        "scheduler", "fifo", "nanovllm-scheduler-fifo", "0.1.0", "nanovllm_scheduler_fifo.scheduler"
    ]
    assert ("attention", "torch") in rows and ("model", "Qwen3ForCausalLM") in rows
    assert "selected by the defaults: scheduler = 'fifo'" in out


def test_plugins_marks_the_selection_of_a_config_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config_file = tmp_path / "nanovllm.toml"
    config_file.write_text('model = "/models/m"\n\n[plugins]\nscheduler = "fifo"\nattention = "torch"\n')
    code, out, _ = run(capsys, "plugins", "--config", str(config_file))
    torch_row = next(line for line in out.splitlines() if " torch " in line)
    assert torch_row.startswith("*")
    selection = "scheduler = 'fifo', block_manager = 'prefix_cache', attention = 'torch'"
    assert f"selected by file {config_file}: {selection}" in out


# --- nanovllm generate, and conflicts between plugins -----------------------------------------------


def test_generate_reads_the_config_file(capsys: pytest.CaptureFixture, tmp_path: Path, tmp_path_factory) -> None:
    from nanovllm_testing.conformance import shared_tiny_checkpoint

    config = tmp_path / "nanovllm.toml"
    config.write_text(
        f'model = "{shared_tiny_checkpoint(tmp_path_factory)}"\ndevice = "cpu"\nkvcache_block_size = 16\n'
        'num_kvcache_blocks = 32\nmax_model_len = 128\n\n[plugins]\nattention = "torch"\n'
    )
    code, out, _ = run(capsys, "generate", "--config", str(config), "--prompt", "Hello", "--max-tokens", "3",
                       "--ignore-eos", "--no-progress")
    assert code == 0 and "--- prompt: 'Hello'" in out and "(3 tokens, length)" in out and "'torch'" in out


def conflicting_plugin() -> types.ModuleType:
    """An in-process plugin that registers ``fifo`` again (a conflict) and ``fifo_copy`` (no conflict)."""
    from nanovllm_scheduler_fifo import FifoScheduler

    plugin = types.ModuleType("conflicting_cli_plugin")
    plugin.NANOVLLM_PLUGIN_API = PLUGIN_API_VERSION

    def nanovllm_register_schedulers(register):
        register("fifo", type("FifoAgain", (FifoScheduler,), {}))
        register("fifo_copy", type("FifoCopy", (FifoScheduler,), {}))

    plugin.nanovllm_register_schedulers = hookimpl(nanovllm_register_schedulers)
    return plugin


@pytest.fixture
def conflict() -> Iterator[None]:
    register_plugin(conflicting_plugin())
    yield
    unregister_plugin("conflicting_cli_plugin")


def test_plugins_lists_everything_and_marks_a_conflict(capsys: pytest.CaptureFixture, conflict: None) -> None:
    code, out, _ = run(capsys, "plugins")
    assert code == 1  # documented: a conflict, like a broken plugin, makes `nanovllm plugins` exit 1
    rows = [line.split() for line in out.split("\n\n")[0].splitlines()[1:]]
    fifo_rows = [row for row in rows if row[2] == "fifo"]
    assert [row[0] for row in fifo_rows] == ["*!", "*!"]  # selected by default, and conflicting
    assert {row[3] for row in fifo_rows} == {"nanovllm-scheduler-fifo", "(registered"}
    assert ["scheduler", "fifo_copy"] == [row for row in rows if "fifo_copy" in row][0][:2]
    assert any(row[:2] == ["attention", "torch"] for row in rows) and any("Qwen3ForCausalLM" in row for row in rows)
    assert "two plugins register a scheduler named 'fifo':" in out and "nanovllm-scheduler-fifo 0.1.0" in out
    assert "error: the selected scheduler 'fifo' is registered by more than one plugin" in out


def test_generate_with_another_name_of_a_conflicting_kind(
    capsys: pytest.CaptureFixture, conflict: None, tiny_config: Path
) -> None:
    code, out, err = run(capsys, "generate", "--config", str(tiny_config), "--scheduler", "fifo_copy",
                         "--prompt", "Hello", "--max-tokens", "2", "--ignore-eos", "--no-progress")
    assert code == 0, err
    assert "(2 tokens, length)" in out
    code, _, err = run(capsys, "generate", "--config", str(tiny_config), "--prompt", "Hello", "--no-progress")
    assert code == 2
    assert "two plugins register a scheduler named 'fifo'" in err
    assert "nanovllm-scheduler-fifo 0.1.0" in err and "(registered in-process)" in err


@pytest.fixture
def tiny_config(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nanovllm_testing.conformance import shared_tiny_checkpoint

    config = tmp_path / "tiny.toml"
    config.write_text(
        f'model = "{shared_tiny_checkpoint(tmp_path_factory)}"\ndevice = "cpu"\nkvcache_block_size = 16\n'
        'num_kvcache_blocks = 32\nmax_model_len = 128\n\n[plugins]\nattention = "torch"\n'
    )
    return config


def test_generate_exits_1_when_every_prompt_failed(capsys: pytest.CaptureFixture, tiny_config: Path) -> None:
    base = ["generate", "--config", str(tiny_config), "--max-tokens", "2", "--no-progress"]
    code, out, err = run(capsys, *base, "--prompt", "", "--prompt", "")
    assert code == 1 and out.count("error: ") == 2 and "every prompt failed (2 of 2)" in err
    code, out, _ = run(capsys, *base, "--prompt", "", "--prompt", "Hello")
    assert code == 0 and out.count("error: ") == 1


