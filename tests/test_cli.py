"""The ``nanovllm`` command: ``plugins``, ``config`` (and its generated reference), ``--config`` everywhere."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from nanovllm_core import hookimpl, register_plugin, unregister_plugin
from nanovllm_core.cli import build_parser, config_reference, main
from nanovllm_core.config import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "nanovllm.toml"
    path.write_text('model = "/models/m"\nmax_num_seqs = 8\n\n[plugins]\nscheduler = "fifo"\nattention = "torch"\n')
    return path


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- nanovllm config --------------------------------------------------------------------------------


def test_docs_config_md_is_up_to_date() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == config_reference(), (
        "docs/config.md is out of date: run `.venv/bin/nanovllm config --reference > docs/config.md`"
    )


def test_the_reference_lists_every_field_with_its_default_and_flag() -> None:
    reference = config_reference()
    for name, field in EngineConfig.model_fields.items():
        if name != "plugins":
            assert f"| `{name}` |" in reference and (field.description or "") in reference
    assert "| `max_num_seqs` | integer ≥ 1 | `256` | `--max-num-seqs` |" in reference
    assert '`"auto"` \\| `"cpu"` \\| `"cuda"`' in reference
    assert "| `plugins.scheduler` | string | `\"fifo\"` | `--scheduler` |" in reference
    assert "`--[no-]enforce-eager`" in reference


def test_config_prints_each_value_with_its_source(capsys: pytest.CaptureFixture, config_file: Path) -> None:
    code, out, _ = run(capsys, "config", "--config", str(config_file), "--max-num-seqs", "4", "--dtype", "float32")
    assert code == 0
    lines = {line.split("#")[0].strip(): line.rsplit("# ", 1)[1] for line in out.splitlines() if " = " in line}
    assert lines['model = "/models/m"'] == f"file {config_file}"
    assert lines["max_num_seqs = 4"] == "command line"
    assert lines['dtype = "float32"'] == "command line"
    assert lines["max_num_batched_tokens = 16384"] == "default"
    assert lines['scheduler = "fifo"'] == f"file {config_file}"
    assert lines['block_manager = "prefix_cache"'] == "default"
    parsed = tomllib.loads(out)  # the output is itself a config file
    resolved = EngineConfig.load(config_file, cli_overrides={"max_num_seqs": 4, "dtype": "float32"})
    assert EngineConfig(**parsed).model_dump() == resolved.model_dump()


def test_config_without_a_model_says_how_to_set_it(capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "config")
    assert code == 2 and "model is not set" in err and "--model" in err


def test_config_reports_an_invalid_value(capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "config", "--model", "/m", "--kvcache-block-size", "100")
    assert code == 2 and "kvcache_block_size" in err and "power of two" in err


def test_config_reference_flag(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "config", "--reference")
    assert code == 0 and out == config_reference()


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


def test_plugins_marks_the_selection_of_a_config_file(capsys: pytest.CaptureFixture, config_file: Path) -> None:
    code, out, _ = run(capsys, "plugins", "--config", str(config_file))
    torch_row = next(line for line in out.splitlines() if " torch " in line)
    assert torch_row.startswith("*")
    selection = "scheduler = 'fifo', block_manager = 'prefix_cache', attention = 'torch'"
    assert f"selected by file {config_file}: {selection}" in out


def test_plugins_reports_a_selection_that_is_not_installed(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[plugins]\nscheduler = "nope"\n')
    code, out, _ = run(capsys, "plugins", "--config", str(config))
    assert code == 1 and "error: scheduler 'nope' is not installed (installed: " in out and "fifo" in out


def test_plugins_shows_broken_plugins_with_their_error(capsys: pytest.CaptureFixture) -> None:
    plugin = types.ModuleType("broken_cli_plugin")

    def nanovllm_register_schedulers(reg):  # wrong argument name
        reg("x", object)

    plugin.nanovllm_register_schedulers = hookimpl(nanovllm_register_schedulers)
    register_plugin(plugin)
    try:
        code, out, _ = run(capsys, "plugins")
    finally:
        unregister_plugin("broken_cli_plugin")
    assert code == 1
    broken = out.split("broken plugins (not loaded):")[1]
    assert "broken_cli_plugin ((registered in-process)): nanovllm_register_schedulers(reg) has the wrong" in broken
    assert "fifo" in out  # the others still load


# --- every command takes --config; generate and bench keep their flags -----------------------------


@pytest.mark.parametrize("command", ["generate", "bench", "plugins", "config"])
def test_every_command_takes_config(command: str) -> None:
    assert build_parser().parse_args([command, "--config", "x.toml"]).config == "x.toml"


def test_generate_and_bench_keep_their_flags() -> None:
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "a", "--prompt", "b", "--max-tokens", "3", "--temperature", "0.5",
         "--max-num-seqs", "4", "--scheduler", "fifo", "--attention", "torch", "--no-enable-prefix-caching"]
    )
    assert (args.model, args.prompt, args.max_tokens, args.temperature) == ("m", ["a", "b"], 3, 0.5)
    assert (args.max_num_seqs, args.plugin_scheduler, args.plugin_attention) == (4, "fifo", "torch")
    assert args.enable_prefix_caching is False
    bench = build_parser().parse_args(["bench", "--max-num-seqs", "8", "--attention", "torch"])
    assert (bench.max_num_seqs, bench.plugin_attention, bench.func.__name__) == (8, "torch", "cmd_bench")


def test_generate_reads_the_config_file(capsys: pytest.CaptureFixture, tmp_path: Path, tmp_path_factory) -> None:
    from nanovllm_core.testing.conformance import shared_tiny_checkpoint

    config = tmp_path / "nanovllm.toml"
    config.write_text(
        f'model = "{shared_tiny_checkpoint(tmp_path_factory)}"\ndevice = "cpu"\nkvcache_block_size = 16\n'
        'num_kvcache_blocks = 32\nmax_model_len = 128\n\n[plugins]\nattention = "torch"\n'
    )
    code, out, _ = run(capsys, "generate", "--config", str(config), "--prompt", "Hello", "--max-tokens", "3",
                       "--ignore-eos", "--no-progress")
    assert code == 0 and "--- prompt: 'Hello'" in out and "(3 tokens, length)" in out and "'torch'" in out
