"""docs/evaluating-a-scheduler.md's simulated figures are what ``nanovllm simulate`` gives today: two rows of its
validation table (the runs measured at 97a9e98) simulated again with the commands the page lists (a changed
policy, engine core or calibration shows here, and the page's table is then to be simulated again)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nanovllm_core.cli import main as cli_main

DOC = Path(__file__).resolve().parents[3] / "docs" / "evaluating-a-scheduler.md"  # the repository's
ROWS = {  # (workload and load, policy): the page's command for that row's simulation
    ("sharegpt-synth, 30% (49.1 req/s)", "`fifo`"): (
        "--dataset sharegpt-synth --num-prompts 1000 --client-processes 4 --priorities 0,1 --request-rate 49.1 "
        "--warm-prefix-cache 1000"
    ).split(),
    ("nano-vllm, 146.9 req/s (3x saturation)", "`priority`"): (
        "--dataset nano --num-prompts 512 --client-processes 4 --priorities 0,1 --request-rate 146.9 "
        "--scheduler priority --max-num-batched-tokens 2048"
    ).split(),
}
KEYS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def documented(label: tuple[str, str]) -> list[float]:
    """The simulated figure (before the slash) of each cell of the validation table's row ``label``."""
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| {label[0]} | {label[1]} |"):
            cells = [c.strip() for c in line.strip("|").split("|")][2:]
            return [float(re.match(r"[\d,.]+", c).group().replace(",", "")) for c in cells]
    raise AssertionError(f"{DOC.name} has no validation row {label!r}")


@pytest.mark.parametrize("label", list(ROWS), ids=[f"{w} {p}" for w, p in ROWS])
def test_documented_row_is_reproduced(label, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["simulate", *ROWS[label], "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    for key, shown in zip(KEYS, documented(label)):
        assert result[key] == pytest.approx(shown, abs=0.051 if shown < 100 else 0.51), (
            f"{key}: simulated {result[key]:.2f}, page {shown}"
        )
