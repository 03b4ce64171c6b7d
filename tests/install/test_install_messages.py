"""What a user of a partial install is told: each missing name of ours names the distribution that ships it,
``nanovllm plugins`` flags every missing role, the kits import without pytest, and a config file that is not
UTF-8 is a one-line error. In-process and fast; ``test_wheels.py`` checks the same from installed wheels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm_core import ConfigError, LLMEngine, ModelLoadError, UnknownPluginError
from nanovllm_core.cli import main
from nanovllm_core.config import EngineConfig, read_config_file
from nanovllm_core.engine.config_resolver import finish_config
from nanovllm_core.engine.model_core import select_attention_backend
from nanovllm_core.plugins import PROVIDERS, PluginRegistry, build_registry, new_plugin_manager


def empty_registry() -> PluginRegistry:
    return PluginRegistry(plugin_manager=new_plugin_manager())


@pytest.mark.parametrize(
    "kind, name, dist",
    [("scheduler", "fifo", "nanovllm-scheduler-fifo"), ("block_manager", "prefix_cache", "nanovllm-scheduler-fifo"),
     ("scheduler", "mixed", "nanovllm-scheduler-mixed"), ("scheduler", "priority", "nanovllm-scheduler-priority"),
     ("attention", "torch", "nanovllm-attention-flash"), ("attention", "triton", "nanovllm-attention-flash"),
     ("attention", "flash_attn", "nanovllm-attention-flash"), ("model", "Qwen3ForCausalLM", "nanovllm-models-qwen3"),
     ("model", "Qwen2ForCausalLM", "nanovllm-models-qwen3"), ("model", "Qwen3MoeForCausalLM", "nanovllm-models-qwen3")],
)
def test_a_missing_name_of_ours_names_its_distribution(kind: str, name: str, dist: str) -> None:
    with pytest.raises(UnknownPluginError) as info:
        empty_registry().get(kind, name)
    label = kind.replace("_", " ")
    assert str(info.value) == (
        f"no {label} named {name!r} is installed; installed: none. It ships in {dist}: pip install {dist}"
    )


def test_the_table_names_what_the_plugins_register() -> None:
    """Every name in the table is registered by the distribution it names, when that one is installed here."""
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    for kind, names in PROVIDERS.items():
        for name, dist in names.items():
            if name in registry.registrations[kind]:
                assert registry.registrations[kind][name].distribution == dist, (kind, name)
    for kind, regs in registry.registrations.items():
        for name, reg in regs.items():
            if reg.distribution.startswith("nanovllm-") and reg.distribution != "nanovllm-core":
                assert PROVIDERS[kind].get(name) == reg.distribution, f"{kind} {name!r} is missing from PROVIDERS"


def test_an_unknown_name_gets_no_example_package() -> None:
    with pytest.raises(UnknownPluginError) as info:
        empty_registry().get("scheduler", "nope")
    assert str(info.value) == (
        "no scheduler named 'nope' is installed; installed: none. Install the plugin that registers it, or fix "
        "[plugins] scheduler."
    )


def test_no_attention_backend_at_all_says_what_to_install() -> None:
    with pytest.raises(ConfigError) as info:
        select_attention_backend(empty_registry(), "auto", torch.device("cpu"), torch.float32, 64, 16)
    assert str(info.value) == (
        "no attention backend is installed; torch, triton, flash_attn, flashinfer ship in nanovllm-attention-flash "
        "and nanovllm-attention-flashinfer: pip install nanovllm-attention-flash nanovllm-attention-flashinfer"
    )


def test_a_missing_architecture_of_ours_names_its_distribution(
    qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = build_registry()
    registry.registrations["model"].clear()
    monkeypatch.setattr("nanovllm_core.engine.model_core.get_registry", lambda: registry)
    with pytest.raises(ModelLoadError) as info:
        LLMEngine(str(qwen3_path))
    assert str(info.value) == (
        "architecture 'Qwen3ForCausalLM' is not provided by any installed model plugin; installed: none. "
        "It ships in nanovllm-models-qwen3: pip install nanovllm-models-qwen3"
    )



def test_data_parallel_without_its_distribution_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nanovllm_core.engine.config_resolver.get_registry", empty_registry)
    config = EngineConfig(model="m", data_parallel_size=2)
    with pytest.raises(UnknownPluginError) as info:
        finish_config(config)  # before the checkpoint is read: nothing starts
    assert str(info.value) == (
        "no data parallel backend named 'mp' is installed; installed: none. It ships in nanovllm-data-parallel: "
        "pip install nanovllm-data-parallel"
    )

def test_plugins_flags_every_missing_role(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nanovllm_core.plugins.get_registry", empty_registry)
    code = main(["plugins"])
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 1
    assert errors == [
        "error: scheduler 'fifo' is not installed (installed: none). It ships in nanovllm-scheduler-fifo: "
        "pip install nanovllm-scheduler-fifo",
        "error: block_manager 'prefix_cache' is not installed (installed: none). It ships in "
        "nanovllm-scheduler-fifo: pip install nanovllm-scheduler-fifo",
        "error: no attention backend is installed; torch, triton, flash_attn, flashinfer ship in "
        "nanovllm-attention-flash and nanovllm-attention-flashinfer: pip install nanovllm-attention-flash "
        "nanovllm-attention-flashinfer",
        "error: no model is installed; Qwen3ForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM ship in "
        "nanovllm-models-qwen3: pip install nanovllm-models-qwen3",
    ]


def test_the_kits_import_without_pytest() -> None:
    code = (
        "import sys; sys.modules['pytest'] = None\n"  # `import pytest` now raises ModuleNotFoundError
        "import nanovllm_testing.conformance, nanovllm_testing.simulated\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_config_file_that_is_not_utf8_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('model = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert str(info.value) == (
        f"config file {str(path)!r} is not UTF-8 text (byte 0xe9 at offset 12); TOML files are UTF-8: save it as UTF-8"
    )
