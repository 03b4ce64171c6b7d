"""A vLLM user's surface: ``vllm serve`` command lines from vLLM's documentation resolve to the configuration they
mean (without loading a model), vLLM's YAML ``--config``, ``VLLM_API_KEY``, ``RequestOutputKind``, ``--demo`` on
``serve`` and ``config`` (``bench``'s: plugins/bench/tests), and ``nanovllm config`` checking what ``generate``
checks."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from unit_helpers import needs_model_plugin

from nanovllm_core import LLMEngine
from nanovllm_core.cli import build_parser, cli_overrides, main, parse_command_line
from nanovllm_core.config import EngineConfig
from nanovllm_core.errors import ConfigError, NanoVLLMError
from nanovllm_core.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_core.serving.serve import resolve_api_key, resolve_model

# Command lines as vLLM's documentation writes them (docs.vllm.ai: the quickstart and OpenAI-compatible server
# pages, serve_args, the CLI reference's examples; the last group are vLLM flags each spelled as its reference
# documents them), with the engine and server settings each must resolve to.
VLLM_COMMAND_LINES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("vllm serve facebook/opt-125m", {"model": "facebook/opt-125m"}, {"served_model_name": ["facebook/opt-125m"]}),
    (
        "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
        {"model": "NousResearch/Meta-Llama-3-8B-Instruct", "dtype": "auto"},
        {"api_key": "token-abc123"},
    ),
    ("vllm serve meta-llama/Llama-2-70b-hf --tensor-parallel-size 4", {"tensor_parallel_size": 4}, {}),
    (
        "vllm serve mistralai/Mistral-7B-v0.1 --gpu-memory-utilization 0.95 --max-model-len 8192",
        {"gpu_memory_utilization": 0.95, "max_model_len": 8192},
        {},
    ),
    ("vllm serve meta-llama/Llama-2-7b-hf --enable-prefix-caching", {"enable_prefix_caching": True}, {}),
    ("vllm serve facebook/opt-125m --host 0.0.0.0 --port 8080", {}, {"host": "0.0.0.0", "port": 8080}),
    (
        "vllm serve Qwen/Qwen3-0.6B --max-model-len 4096 --gpu-memory-utilization 0.8",
        {"model": "Qwen/Qwen3-0.6B", "max_model_len": 4096, "gpu_memory_utilization": 0.8},
        {},
    ),
    (
        'vllm serve ./merged --gpu-memory-utilization=0.8 --port 6002 --served-model-name="VLINSTRUCT" '
        "--max-model-len 8192",
        {"model": "./merged", "gpu_memory_utilization": 0.8, "max_model_len": 8192},
        {"port": 6002, "served_model_name": ["VLINSTRUCT"]},
    ),
    (
        "vllm serve Qwen/Qwen3-8B -tp 2 --max-num-seqs 128 --max-num-batched-tokens 8192 --enforce-eager",
        {"tensor_parallel_size": 2, "max_num_seqs": 128, "max_num_batched_tokens": 8192, "enforce_eager": True},
        {},
    ),
    (
        "vllm serve Qwen/Qwen3-8B --scheduling-policy priority --block-size 16 --kv-cache-dtype fp8",
        {"plugins.scheduler": "priority", "kvcache_block_size": 16, "kv_cache_dtype": "fp8"},
        {},
    ),
    (
        "vllm serve Qwen/Qwen3-8B --scheduling-policy fcfs --long-prefill-token-threshold 512",
        {"plugins.scheduler": "mixed", "plugins.scheduler_options": {"long_prefill_token_threshold": 512}},
        {},
    ),
    (
        "vllm serve Qwen/Qwen3-8B --no-enable-prefix-caching --async-scheduling --num-gpu-blocks-override 1024",
        {"enable_prefix_caching": False, "async_scheduling": "on", "num_kvcache_blocks": 1024},
        {},
    ),
    (
        "vllm serve Qwen/Qwen3-8B --attention-backend FLASH_ATTN --dtype half --seed 42 --generation-config vllm",
        {"plugins.attention": "flash_attn", "dtype": "float16", "seed": 42, "generation_config": "vllm"},
        {},
    ),
    (
        "vllm serve Qwen/Qwen3-8B --attention-backend TRITON_ATTN -dp 2 --uvicorn-log-level warning",
        {"plugins.attention": "triton", "data_parallel_size": 2},
        {"log_level": "warning"},
    ),
    ("vllm serve Qwen/Qwen3-8B --attention-backend TORCH_SDPA", {"plugins.attention": "torch"}, {}),
    ("vllm serve Qwen/Qwen3-8B --max-model-len 32k", {"max_model_len": 32000}, {}),
    ("vllm serve Qwen/Qwen3-8B --max-model-len 32K", {"max_model_len": 32768}, {}),
    ("vllm serve Qwen/Qwen3-8B --max-model-len 25.6k", {"max_model_len": 25600}, {}),
]


def resolve_serve(argv: list[str], environ: dict[str, str] | None = None) -> tuple[EngineConfig, Any]:
    """What ``nanovllm serve ARGV`` would run with, without loading anything: the engine configuration and the
    parsed server flags."""
    args = parse_command_line(argv)
    overrides = cli_overrides(args)
    resolve_model(args, overrides)
    args.api_key = resolve_api_key(args.api_key, environ or {})
    return EngineConfig.load(args.config, cli_overrides=overrides), args


def value_at(config: EngineConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("command", "engine", "server"), VLLM_COMMAND_LINES, ids=[c[0] for c in VLLM_COMMAND_LINES])
def test_a_vllm_serve_command_line_resolves_to_what_it_means(
    command: str, engine: dict[str, Any], server: dict[str, Any]
) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["vllm", "serve"]
    config, args = resolve_serve(argv[1:])
    for path, expected in engine.items():
        assert value_at(config, path) == expected, path
    for name, expected in server.items():
        assert getattr(args, name) == expected, name
    untouched = {p.split(".")[0] for p in engine} | {"model"}
    defaults = EngineConfig(model="m")
    for name in EngineConfig.model_fields:
        if name not in untouched and name != "plugins":  # nothing else moves
            assert getattr(config, name) == getattr(defaults, name), name


def test_both_spellings_resolve_to_one_setting() -> None:
    pairs = [
        ("--block-size 32", "--kvcache-block-size 32"),
        ("--num-gpu-blocks-override 8", "--num-kvcache-blocks 8"),
        ("--attention-backend TRITON_ATTN", "--attention triton"),
        ("--scheduling-policy fcfs", "--scheduler mixed"),
        ("--async-scheduling", "--async-scheduling on"),
        ("--no-async-scheduling", "--async-scheduling off"),
        ("-tp 2", "--tensor-parallel-size 2"),
        ("-dp 2", "--data-parallel-size 2"),
        ("--dtype float", "--dtype float32"),
    ]
    for theirs, ours in pairs:
        a, _ = resolve_serve(["serve", "/m", *theirs.split()])
        b, _ = resolve_serve(["serve", "/m", *ours.split()])
        assert a.model_dump() == b.model_dump(), theirs
    for command in ("generate", "config"):  # every command with engine flags takes vLLM's spellings
        args = build_parser().parse_args([command, "--block-size", "16", "--scheduling-policy", "priority"])
        assert cli_overrides(args) == {"kvcache_block_size": 16, "plugins": {"scheduler": "priority"}}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--attention-backend", "FLEX_ATTENTION"],
            "vLLM's attention backend 'FLEX_ATTENTION' has no counterpart here",
        ),
        (["--scheduling-policy", "lifo"], "'lifo' is not a scheduling policy; allowed: fcfs (the mixed scheduler)"),
        (["--async-scheduling", "maybe"], "invalid choice"),
        (["--max-model-len", "4x"], "'4x' is not an integer; allowed: digits, or with k/m/g"),
        (["--max-model-len", "1.0001k"], "'1.0001k' is not a whole number of tokens"),
    ],
)
def test_a_vllm_value_without_a_counterpart_exits_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--model", "/m", *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_threshold_keeps_the_files_other_scheduler_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.toml"
    path.write_text('model = "/m"\n[plugins]\nscheduler = "priority"\nscheduler_options = { aging_steps = 5 }\n')
    options = EngineConfig.load(path, cli_overrides={"plugins": {"scheduler_options": {"x": 1}}}).plugins
    assert options.scheduler_options == {"aging_steps": 5, "x": 1}


# --- vLLM's YAML config ---------------------------------------------------------------------------------

VLLM_DOCS_YAML = """\
# config.yaml, as vLLM's serve_args page shows it
model: meta-llama/Llama-3.1-8B-Instruct
host: "127.0.0.1"
port: 6379
uvicorn-log-level: "info"
tensor-parallel-size: 2
enable-prefix-caching: false
max_model_len: 4096
served-model-name: [llama, llama-8b]
"""


def test_a_vllm_yaml_config_resolves_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(VLLM_DOCS_YAML)
    config, args = resolve_serve(["serve", "--config", str(path)])
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct" and config.tensor_parallel_size == 2
    assert config.enable_prefix_caching is False and config.max_model_len == 4096
    assert (args.host, args.port, args.log_level) == ("127.0.0.1", 6379, "info")
    assert args.served_model_name == ["llama", "llama-8b"] and args.config is None
    # command line > config file, and the MODEL argument wins over the file's model (as in vLLM)
    config, args = resolve_serve(["serve", "/other", f"--config={path}", "--port", "9000", "-tp", "1"])
    assert (config.model, config.tensor_parallel_size, args.port) == ("/other", 1, 9000)


def test_nanovllm_config_reads_a_vllm_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "engine.yml"
    path.write_text("model: /m\nblock-size: 32\nscheduling-policy: fcfs\nenforce-eager: true\n")
    assert main(["config", "--config", str(path), "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    for line in ("kvcache_block_size = 32", 'scheduler = "mixed"', "enforce_eager = true", "max_num_seqs = 8"):
        assert line in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trust-remote-code: true\n", "'trust-remote-code' is not a flag of nanovllm serve"),
        ("port: [1\n", "is not valid YAML"),
        ("- a\n- b\n", "a YAML mapping of flag names to values"),
    ],
)
def test_a_bad_yaml_config_is_one_line_and_exit_2(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_yaml_without_pyyaml_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("port: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    assert main(["serve", "--config", str(path)]) == 2
    assert "needs PyYAML: pip install pyyaml" in capsys.readouterr().err


def test_a_yaml_file_given_to_python_says_where_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("max-model-len: 4096\n")
    with pytest.raises(ConfigError, match="read by the --config of nanovllm generate, serve, bench and config only"):
        EngineConfig.load(path)


# --- API key, RequestOutputKind -------------------------------------------------------------------------


def test_api_key_precedence_flag_then_nanovllm_then_vllm() -> None:
    both = {"NANOVLLM_API_KEY": "ours", "VLLM_API_KEY": "theirs"}
    assert resolve_api_key("flag", both) == "flag"
    assert resolve_api_key(None, both) == "ours"
    assert resolve_api_key(None, {"VLLM_API_KEY": "theirs"}) == "theirs"
    assert resolve_api_key(None, {"NANOVLLM_API_KEY": "", "VLLM_API_KEY": "theirs"}) == "theirs"
    assert resolve_api_key(None, {}) is None
    assert build_parser().parse_args(["serve", "/m"]).api_key is None  # read at start, not when parsing


@needs_model_plugin
def test_request_output_kind_is_accepted_where_output_kind_strings_are(qwen3_path: Path) -> None:
    assert [k.value for k in RequestOutputKind] == ["cumulative", "delta", "final"]
    for kind, name in ((RequestOutputKind.DELTA, "delta"), (RequestOutputKind.FINAL_ONLY, "final")):
        params = SamplingParams(output_kind=kind)
        assert params.output_kind == name and type(params.output_kind) is str
    with pytest.raises(NanoVLLMError, match="RequestOutputKind.FINAL_ONLY"):
        SamplingParams(output_kind="everything")
    engine = LLMEngine(str(qwen3_path), device="cpu", num_kvcache_blocks=16, kvcache_block_size=16)
    outputs: dict[str, list[Any]] = {}
    for request_id, kind in (("delta", RequestOutputKind.DELTA), ("cumulative", RequestOutputKind.CUMULATIVE)):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=kind)
        engine.add_request(request_id, [1, 2, 3], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(list(out.outputs[0].token_ids))
    deltas, cumulative = outputs["delta"], outputs["cumulative"]
    assert len(deltas) == len(cumulative) == 4  # one output per step for both
    assert sum(deltas, []) == cumulative[-1] and len(cumulative[-1]) == 4


# --- nanovllm config checks what generate checks --------------------------------------------------------


def engine_error(path: Path, **kwargs: Any) -> str:
    with pytest.raises(NanoVLLMError) as info:
        LLMEngine(str(path), device="cpu", **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    ("flags", "kwargs"),
    [
        (["--scheduler", "lifo"], {"plugins": {"scheduler": "lifo"}}),
        (["--long-prefill-token-threshold", "64"], {"plugins": {"scheduler_options": {
            "long_prefill_token_threshold": 64}}}),  # fifo takes no options  # fmt: skip
        (["--scheduling-policy", "fcfs", "--long-prefill-token-threshold", "-1"], {"plugins": {
            "scheduler": "mixed", "scheduler_options": {"long_prefill_token_threshold": -1}}}),  # fmt: skip
        (["--max-model-len", "4096"], {"max_model_len": 4096}),  # beyond the checkpoint's 1,024 positions
    ],
)
def test_config_fails_as_generate_does(
    qwen3_path: Path, flags: list[str], kwargs: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    assert main(["config", "--model", str(qwen3_path), *flags]) == 2
    assert capsys.readouterr().err == f"error: {engine_error(qwen3_path, **kwargs)}\n"


@needs_model_plugin
def test_config_takes_unknown_plugin_options_from_a_file_as_generate_does(
    qwen3_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[plugins]\nscheduler = "priority"\nscheduler_options = { agin_steps = 1 }\n')
    assert main(["config", "--model", str(qwen3_path), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'aging_steps'?" in err
    assert err == f"error: {engine_error(qwen3_path, config=path)}\n"


# --- --demo ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanovllm-cache")


@needs_model_plugin
def test_demo_on_serve_and_config(
    demo_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(demo_cache))
    assert main(["config", "--demo"]) == 0
    out = capsys.readouterr().out
    assert f'model = "{demo_cache / "demo-qwen3-tiny"}"' in out and "max_model_len = 512" in out
    config, args = resolve_serve(["serve", "--demo", "--max-model-len", "256"])
    assert config.model == str(demo_cache / "demo-qwen3-tiny") and config.max_model_len == 256
    assert args.served_model_name == ["demo"]
    with pytest.raises(ConfigError, match="--demo serves the demo checkpoint"):
        resolve_serve(["serve", "/m", "--demo"])
