"""docs/performance.md: every TOML snippet is a valid engine configuration, and the plugin options it sets are
ones the named (installed) plugins accept, so the guide's settings can be pasted into a config file as shown; every
measurement names its command, GPU, date and commit. (tests/docs/test_benchmark_scripts.py runs the commands.)"""

from __future__ import annotations

import re
import subprocess
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


def measured_rows() -> list[list[str]]:
    """The table rows of the page that quote a command: the measurements."""
    rows = []
    for line in DOC.read_text().splitlines():
        if line.startswith("|") and re.search(r"`(python benchmarks/|nanovllm )", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_measurement_says_where_and_when_it_ran() -> None:
    """Each row ends with the command, the GPU, the date and the commit (the lead replaces rows with fresh runs, so
    a row that loses its provenance would pass for current)."""
    rows = measured_rows()
    assert len(rows) >= 10
    for row in rows:
        command, gpu, date, commit = row[-4:]
        assert command.startswith("`") and gpu and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), row


def test_the_commits_of_the_measurements_exist() -> None:
    root = DOC.parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for commit in sorted({row[-1] for row in measured_rows()}):
        proc = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        assert proc.returncode == 0, f"docs/performance.md names commit {commit}, which this repository lacks"


def test_the_page_covers_every_workload() -> None:
    text = DOC.read_text()
    for workload in ("0.6b-bf16", "0.6b-fp8", "8b-bf16", "8b-fp8", "single-0.6b"):
        assert re.search(rf"--workloads {re.escape(workload)}( --runs \d+)?`", text), workload
    for section in ("## Offline", "### The fp8 KV cache: speed and accuracy", "## Online", "## Scheduler policies"):
        assert section in text, section
