"""The ``nanovllm`` command without a model: its parser, ``config`` (and its generated reference), ``plugins``
errors, ``--config`` everywhere (listing the installed plugins and ``generate``: engine/test_cli_engine.py)."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest
from unit_helpers import needs_model_plugin

from nanovllm_core import PLUGIN_API_VERSION, hookimpl, register_plugin, unregister_plugin
from nanovllm_core.cli import build_parser, config_reference, main
from nanovllm_core.config import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


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
    assert '| `plugins.scheduler` | string | `"fifo"` | `--scheduler` |' in reference
    assert "`--[no-]enforce-eager`" in reference


@needs_model_plugin
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


# --- every command takes --config; generate keeps its flags (bench's: plugins/bench/tests) ----------------


@pytest.mark.parametrize("command", ["generate", "plugins", "config"])
def test_every_command_takes_config(command: str) -> None:
    assert build_parser().parse_args([command, "--config", "x.toml"]).config == "x.toml"


def test_generate_keeps_its_flags() -> None:
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "a", "--prompt", "b", "--max-tokens", "3", "--temperature", "0.5",
         "--max-num-seqs", "4", "--scheduler", "fifo", "--attention", "torch", "--no-enable-prefix-caching"]
    )  # fmt: skip
    assert (args.model, args.prompt, args.max_tokens, args.temperature) == ("m", ["a", "b"], 3, 0.5)
    assert (args.max_num_seqs, args.plugin_scheduler, args.plugin_attention) == (4, "fifo", "torch")
    assert args.enable_prefix_caching is False


# --- hardening: paths, flags that contradict each other, exit codes ---------------------------------


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
                         "--gpu-memory-utilization", "1")  # fmt: skip
    assert code == 0, err
    assert "max_num_seqs = 64" in out and "enforce_eager = true" in out and "gpu_memory_utilization = 1.0" in out


def test_kv_cache_dtype_flag_takes_vllms_e4m3_name(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "config", "--model", "/m", "--kv-cache-dtype", "fp8_e4m3")
    assert code == 0, err
    assert 'kv_cache_dtype = "fp8"' in out
    code, _, err = run(capsys, "config", "--model", "/m", "--kv-cache-dtype", "fp8_e5m2")
    assert code == 2 and "kv_cache_dtype: Input should be 'auto', 'fp8' or 'fp8_e4m3' (got 'fp8_e5m2')" in err


def load_benchmark(name: str):
    """The module of ``benchmarks/NAME.py`` (the benchmarks are scripts, not a package); they import the measuring
    tools, so without ``nanovllm-bench`` the test skips."""
    from nanovllm_testing.scripts import load_script

    pytest.importorskip("nanovllm_bench")

    return load_script(ROOT / "benchmarks" / f"{name}.py")


def time_each_product_once(module, monkeypatch: pytest.MonkeyPatch) -> None:
    """``module.time_linear`` as one call of the product (it makes six on the CPU, and in Triton's interpreter each
    takes up to a second), for the tests that check which rows are reported, not their times."""

    def once(x, weights, iters, fn=module.F.linear):
        start = time.perf_counter()
        fn(x, weights[0])
        return time.perf_counter() - start

    monkeypatch.setattr(module, "time_linear", once)


def test_decode_gemm_benchmark_reports_every_projection_and_row_count(tmp_path, capsys):
    """benchmarks/decode_gemm.py on the CPU (on a GPU it is the measurement): one row per layer and batch size."""
    import json

    module = load_benchmark("decode_gemm")
    out = tmp_path / "gemm.json"
    assert module.main(["--shape", "tiny", "--rows", "1,8", "--iters", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    layers = {(r["layer"], r["rows"]) for r in report["results"]}
    assert layers == {(name, m) for name in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 8)}
    assert all(r["us"] > 0 and r["weight_tb_per_s"] > 0 for r in report["results"])
    qkv = next(r for r in report["results"] if r["layer"] == "qkv")
    assert (qkv["in"], qkv["out"]) == (64, (4 + 2 * 2) * 32)  # the tiny shape's fused q, k and v
    assert "lm_head" in capsys.readouterr().out


def test_decode_gemm_benchmark_times_the_norm_in_the_skinny_kernels_prologue(tmp_path, capsys, monkeypatch):
    """``--norm`` on the CPU: for the projections a norm precedes, one row with the norm in the prologue and one with
    it separate, per row count the skinny kernel takes."""
    import json

    module = load_benchmark("decode_gemm")
    time_each_product_once(module, monkeypatch)
    out = tmp_path / "gemm.json"
    argv = ["--shape", "tiny", "--rows", "1,8", "--iters", "2", "--norm", "--json", str(out)]
    assert module.main(argv) == 0
    normed = [r for r in json.loads(out.read_text())["results"] if "norm" in r]
    assert {(r["layer"], r["rows"], r["norm"]) for r in normed} == {
        (layer, 1, norm) for layer in ("qkv", "gate_up") for norm in ("prologue", "separate")
    }
    assert all(r["blas"] == "skinny" and r["us"] > 0 for r in normed)
    assert "norm prologue" in capsys.readouterr().out


def test_decode_gemm_benchmark_times_the_norm_in_the_fp8_weight_only_kernel(monkeypatch):
    """``--fp8 --norm`` (its own part: the rest is timed above): for the projections a norm precedes, the FP8
    weight-only kernel with the norm (and gate-up's SiLU-and-mul) in its launch and with the core's kernels around
    it, per-channel and block-scaled weights, at the row counts that kernel takes."""
    pytest.importorskip("nanovllm_quant_fp8")
    module = load_benchmark("decode_gemm")
    torch = pytest.importorskip("torch")
    time_each_product_once(module, monkeypatch)
    normed = module.measure_fp8_norm("tiny", [1, 17], 1, torch.device("cpu"))
    assert {(r["blas"], r["layer"], r["rows"], r["norm"]) for r in normed} == {
        (f"w8a16-{kind}", layer, 1, norm)
        for kind in ("channel", "block")
        for layer in ("qkv", "gate_up")
        for norm in ("prologue", "separate", "epilogue", "norm-only")
        if layer == "gate_up" or norm in ("prologue", "separate")
    }
    assert all(r["us"] > 0 for r in normed)


def test_decode_gemm_benchmark_times_the_weight_only_kernel_with_launch_settings(tmp_path, capsys, monkeypatch):
    """``--fp8 --fp8-config``: the few-row FP8 kernel's rows carry the launch they ran with, the default changed by
    the given settings; a setting that is not a JSON object is a one-line usage error."""
    import json

    pytest.importorskip("nanovllm_quant_fp8")
    module = load_benchmark("decode_gemm")
    time_each_product_once(module, monkeypatch)
    out = tmp_path / "gemm.json"
    late_sum = not module.fp8_configs(1, 64, 64, None, False)[0]["LATE_SUM"]  # the default's other way
    argv = ["--shape", "tiny", "--rows", "1", "--iters", "1", "--blas", "default", "--fp8", "--json", str(out)]
    assert module.main([*argv, "--fp8-config", json.dumps({"LATE_SUM": late_sum})]) == 0
    w8a16 = [r for r in json.loads(out.read_text())["results"] if r["blas"].startswith("w8a16")]
    assert w8a16 and all(r["config"]["LATE_SUM"] is late_sum for r in w8a16)
    with pytest.raises(SystemExit):
        module.main(["--shape", "tiny", "--fp8", "--fp8-config", "[1]"])
    assert "--fp8-config [1]: a JSON object" in capsys.readouterr().err
