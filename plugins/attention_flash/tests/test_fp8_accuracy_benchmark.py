"""``benchmarks/fp8_accuracy.py`` on the CPU (torch backend, a tiny checkpoint, a few tokens): it runs, its JSON
holds what it reports, and its agreement figures follow from the tokens it lists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "fp8_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    from nanovllm_testing.scripts import load_script

    return load_script(SCRIPT)


def test_fp8_accuracy_benchmark_on_cpu(bench, tmp_path: Path, capsys) -> None:
    from nanovllm_testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", "qwen3", head_dim=64)
    out = tmp_path / "fp8.json"
    n = 6
    result = bench.main(["--model", str(model), "--device", "cpu", "--num-tokens", str(n), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["attention"] == "torch" and result["dtype"] == "bfloat16"
    assert result["kv_cache"]["auto"] == "bfloat16" and result["kv_cache"]["fp8"].startswith("uint8")
    errors = result["logits_rel_l2_error_vs_float32_transformers"]
    assert set(errors) == {"auto", "fp8", "transformers_bfloat16"}
    for values in errors.values():
        assert len(values) == 3 and all(math.isfinite(v) and 0 < v < 1 for v in values)
    assert errors["fp8"] != errors["auto"], "the two runs should differ in their cache"
    tokens = result["tokens"]
    assert [len(t) for t in tokens["fp8"]] == [n] * len(bench.PROMPTS)
    for pair, (a, b) in {
        "fp8_vs_auto": ("fp8", "auto"),
        "auto_vs_transformers": ("auto", "transformers"),
        "fp8_vs_transformers": ("fp8", "transformers"),
    }.items():
        expected = bench.agreement(tokens[a], tokens[b], n)
        assert result["greedy_agreement"][pair] == expected
        assert all(0 <= d <= n for d in expected["first_divergence"])
    printed = capsys.readouterr().out
    assert "relative L2 error against float32 transformers" in printed and "fp8_vs_auto" in printed


def test_agreement_counts_equal_tokens_and_first_divergence(bench) -> None:
    ours = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ref = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert bench.agreement(ours, ref, 4) == {"fraction_equal": 7 / 8, "first_divergence": [2, 4]}


def test_bad_token_count_is_refused(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--num-tokens", "0"])
