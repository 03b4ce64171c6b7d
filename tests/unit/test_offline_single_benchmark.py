"""benchmarks/offline.py --single on a tiny checkpoint on the CPU: one request alone, timed, with what the engine's
start-up took and made in its JSON (the figures a GPU row quotes beside the time per token)."""

from __future__ import annotations

import json
from pathlib import Path

from nanovllm_testing.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offline.py"


def test_single_request_reports_its_tokens_and_the_engines_start_up(qwen3_path, tmp_path, monkeypatch, capsys):
    offline = load_script(SCRIPT)
    monkeypatch.setattr(offline, "random_checkpoint", lambda shape: qwen3_path)
    out = tmp_path / "single.json"
    args = ["--single", "--attention", "torch", "--prompt-len", "8", "--output-len", "5", "--runs", "2"]
    args += ["--max-model-len", "64"]
    assert offline.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 5 and len(result["runs"]) == 2
    assert result["ms_per_output_token"] == min(r["ms_per_output_token"] for r in result["runs"]) > 0
    assert result["device"] == "cpu" and result["weights_read_bound_ms"] is None  # the bound is a GPU's
    assert result["load_s"] > 0 and result["num_kvcache_blocks"] > 0
    assert result["graph_capture_s"] is None  # no CUDA graphs on the CPU
    printed = capsys.readouterr().out
    assert f"{result['num_kvcache_blocks']:,} KV-cache blocks" in printed and "start-up" in printed
