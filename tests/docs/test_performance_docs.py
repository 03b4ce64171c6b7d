"""docs/performance.md: every TOML snippet is a valid engine configuration, and the plugin options it sets are
ones the named (installed) plugins accept, so the guide's settings can be pasted into a config file as shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nanovllm_core import EngineConfig
from nanovllm_core.config import read_config_file
from nanovllm_core.engine.options import validate_options
from nanovllm_core.plugins import get_registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
TOML_BLOCKS = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_guide_has_its_snippets() -> None:
    assert len(TOML_BLOCKS) >= 3


@pytest.mark.parametrize("snippet", TOML_BLOCKS, ids=[f"block{i}" for i in range(len(TOML_BLOCKS))])
def test_each_snippet_is_a_valid_config(snippet: str, tmp_path: Path) -> None:
    path = tmp_path / "nanovllm.toml"
    path.write_text('model = "/models/any"\n' + snippet)
    config = EngineConfig.load(path)
    table = read_config_file(path).get("plugins", {})
    for kind in ("scheduler", "block_manager", "attention"):
        if f"{kind}_options" in table:
            cls = get_registry().get(kind, getattr(config.plugins, kind)).obj
            validate_options(kind, cls, getattr(config.plugins, f"{kind}_options"))
