"""The ``nanovllm`` command: ``plugins``, ``config`` (and its generated reference), ``--config`` everywhere."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanovllm_core import PLUGIN_API_VERSION, hookimpl, register_plugin, unregister_plugin
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
    plugin.NANOVLLM_PLUGIN_API = PLUGIN_API_VERSION

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


# --- hardening: conflicts, paths, flags that contradict each other, exit codes ----------------------


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
    from nanovllm_core.testing.conformance import shared_tiny_checkpoint

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


def test_demo_and_model_conflict(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--demo", "--model", "/nonexistent"])
    assert info.value.code == 2
    assert "argument --model: not allowed with argument --demo" in capsys.readouterr().err


def test_a_directory_as_config_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code, _, err = run(capsys, "config", "--model", "/m", "--config", str(tmp_path))
    assert code == 2 and f"config file '{tmp_path}' is a directory; give the path of a TOML file" in err


def test_a_seed_outside_64_bits_fails_at_validation(capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "config", "--model", "/m", "--seed", "99999999999999999999999")
    assert code == 2 and "seed: must be an unsigned 64-bit integer, 0 to 2**64 - 1" in err
    code, out, _ = run(capsys, "config", "--model", "/m", "--seed", str(2**64 - 1))
    assert code == 0 and f"seed = {2**64 - 1}" in out


def test_flags_are_parsed_into_their_types_under_strict_validation(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "config", "--model", "/m", "--max-num-seqs", "64", "--enforce-eager",
                         "--gpu-memory-utilization", "1")
    assert code == 0, err
    assert "max_num_seqs = 64" in out and "enforce_eager = true" in out and "gpu_memory_utilization = 1.0" in out
