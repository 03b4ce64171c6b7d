"""docs/evaluating-a-scheduler.md's simulated figures are what ``nanovllm simulate`` gives today: two rows of its
validation table simulated again with the commands the page lists (a changed policy, engine core or calibration
shows here, and the page's table is then to be simulated again)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nanovllm_core.cli import main as cli_main

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluating-a-scheduler.md"
LONG_PROMPTS = ["--dataset", "random", "--random-input-len", "3000", "--random-output-len", "256",
                "--random-range-ratio", "0.25"]
ROWS = {
    "long prompts, 70% (22.1 req/s), `mixed`": [
        *LONG_PROMPTS, "--num-prompts", "600", "--priorities", "0,1", "--client-processes", "4", "--request-rate",
        "22.1", "--scheduler", "mixed", "--max-num-batched-tokens", "2048",
    ],
    "nano-vllm, 70% (34.6 req/s), `fifo`": [
        "--dataset", "nano", "--num-prompts", "512", "--priorities", "0,1", "--client-processes", "4",
        "--request-rate", "34.6", "--scheduler", "fifo", "--warm-prefix-cache", "512",
    ],
}
KEYS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def documented(label: str) -> list[float]:
    """The simulated figure (before the slash) of each cell of the validation table's row ``label``."""
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| {label} |"):
            cells = [c.strip() for c in line.strip("|").split("|")][1:]
            return [float(re.match(r"[\d,.]+", c).group().replace(",", "")) for c in cells]
    raise AssertionError(f"{DOC.name} has no validation row {label!r}")


@pytest.mark.parametrize("label", list(ROWS))
def test_documented_row_is_reproduced(label, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["simulate", *ROWS[label], "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    for key, shown in zip(KEYS, documented(label)):
        assert result[key] == pytest.approx(shown, abs=0.051), f"{key}: simulated {result[key]:.2f}, page {shown}"
