"""The throughput bound `nanovllm bench` reports: the additive form and the per-step form, by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanovllm_core.benchmark import bound_seconds

CONFIG = SimpleNamespace(
    num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    intermediate_size=16, vocab_size=32,
)
MATMUL_PARAMS = 2 * (8 * 4 * 4 + 2 * 4 * 8 + 3 * 8 * 16) + 32 * 8  # layers x (qkv + o + mlp) + LM head
KV_PER_TOKEN = 2 * 2 * 1 * 4 * 2  # k and v, layers, kv heads, head_dim, bf16 bytes


def test_one_sequence_by_hand():
    # prompt of 3 tokens, 3 output tokens: the prefill gives the first, two decode steps read 4 and 5 tokens
    bandwidth, gemm = 1000.0, 1e6
    b = bound_seconds(CONFIG, [[0, 1, 2]], [3], {"copy_bytes_per_s": bandwidth, "gemm_flop_per_s": gemm})
    weight_bytes = 2 * MATMUL_PARAMS
    # the additive form (as earlier rounds): reads of 4 + 5 tokens, writes of the prompt and every output token
    assert b["bytes_moved"] == KV_PER_TOKEN * (4 + 5) + KV_PER_TOKEN * (3 + 3) + 2 * weight_bytes
    prompt_flops = 2 * MATMUL_PARAMS * 3 + 2 * 2 * 2 * 2 * 4 * 9 / 2  # matmuls, causal QK^T and PV of 3 tokens
    assert b["flops"] == pytest.approx(prompt_flops + 2 * MATMUL_PARAMS * 3)
    assert b["bound_s"] == pytest.approx(b["bytes_moved"] / bandwidth + b["flops"] / gemm)
    expected = max(prompt_flops / gemm, 3 * KV_PER_TOKEN / bandwidth)
    for read in (4, 5):  # each decode step writes one token and reads the context
        step_bytes = weight_bytes + KV_PER_TOKEN * (read + 1)
        expected += max(step_bytes / bandwidth, 2 * MATMUL_PARAMS / gemm)
    assert b["per_step_bound_s"] == pytest.approx(expected)


@pytest.mark.parametrize("gemm", [1e3, 1e6, 1e12])
def test_per_step_form_is_never_above_the_sum(gemm):
    prompts = [[1] * n for n in (5, 1, 9, 3)]
    b = bound_seconds(CONFIG, prompts, [4, 1, 7, 2], {"copy_bytes_per_s": 1e4, "gemm_flop_per_s": gemm})
    assert 0 < b["per_step_bound_s"] <= b["bound_s"] + 1e-12


def test_decode_step_fit_recovers_the_parts():
    from nanovllm_core.benchmark import fit_decode_steps

    # decode steps of 1.2 ms + 2 us a sequence + 0.5 ns a KV token, and two steps with prompt tokens
    records = [(n, n, kv, 1.2 + 0.002 * n + 0.5e-6 * kv) for n, kv in [(256, 300_000), (128, 90_000), (64, 70_000),
                                                                       (8, 9_000), (200, 150_000)]]
    records += [(3, 900, 2_000, 4.0), (1, 500, 500, 1.5)]
    fit = fit_decode_steps(records, kv_bytes_per_token=4096)
    assert fit["decode_steps"] == 5 and fit["prompt_steps"] == 2
    assert fit["prompt_steps_gpu_s"] == pytest.approx(5.5e-3)
    assert fit["fixed_ms_per_step"] == pytest.approx(1.2)
    assert fit["per_seq_us"] == pytest.approx(2.0)
    assert fit["per_kv_token_ns"] == pytest.approx(0.5)
    assert fit["kv_read_bytes_per_s"] == pytest.approx(4096 / 0.5e-9)
    assert fit["fixed_s"] + fit["per_seq_s"] + fit["per_kv_s"] == pytest.approx(fit["decode_steps_gpu_s"])
    assert fit["r2"] == pytest.approx(1.0)
    assert "fixed_ms_per_step" not in fit_decode_steps(records[:3], 4096)  # too few steps to fit three parts


def test_profile_seqs_are_batch_sizes_within_the_workload():
    from nanovllm_core.benchmark import profile_sizes
    from nanovllm_core.errors import ConfigError

    assert profile_sizes("", 256) == [256]
    assert profile_sizes("16, 64,256", 256) == [16, 64, 256]
    for bad in ("0", "300", "16,x", "-4"):
        with pytest.raises(ConfigError, match=r"--profile-seqs .*from 1 to --num-seqs \(256\)"):
            profile_sizes(bad, 256)


def test_a_config_file_without_a_model_runs_on_the_random_weights(tmp_path):
    """`nanovllm bench --config F` where F sets plugins but no model: the bench's random checkpoint, the file's
    plugins (it was refused with 'model: Field required')."""
    import json

    from nanovllm_core.cli import main

    config = tmp_path / "bench.toml"
    config.write_text('[plugins]\nattention = "torch"\n')
    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "tiny", "--num-seqs", "2", "--max-input-len", "100", "--max-output-len", "100",
            "--runs", "1", "--warmup-prompts", "0", "--device", "cpu", "--config", str(config), "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["model"].startswith("/tmp/nanovllm-bench-tiny") and result["attention"] == "torch"


def test_run_step_timing_splits_prompt_and_decode_steps_and_names_the_slowest():
    from nanovllm_core.benchmark import format_run_timing, run_step_timing

    # (sequences, query tokens, KV tokens, GPU ms): two prompt steps, then decode steps of one token a sequence
    records = [(2, 900, 900, 4.0), (1, 300, 300, 1.0)] + [(3, 3, 1000 + i, 1.0 + i / 10) for i in range(8)]
    summary = {"gpu_busy_s": 0.02, "gpu_idle_s": 0.001, "host_prepare_s": 0.004}
    timing = run_step_timing(summary, records)
    assert timing["prompt_steps_s"] == pytest.approx(0.005)
    assert timing["decode_steps_s"] == pytest.approx(sum(1.0 + i / 10 for i in range(8)) / 1e3)
    assert [s["ms"] for s in timing["slowest_decode_steps"]] == pytest.approx([1.7, 1.6, 1.5, 1.4, 1.3])
    assert timing["slowest_decode_steps"][0] == {"seqs": 3, "kv_tokens": 1007, "ms": pytest.approx(1.7)}
    line = format_run_timing(timing)
    assert "prompt steps 0.005" in line and "1.70 ms (3 seqs)" in line and "allocators" not in line
    timing["allocator_growth"] = {
        "pinned_allocs": 3.0, "pinned_alloc_ms": 1.25, "device_segments": 2.0, "device_alloc_retries": 0.0,
    }
    assert "grew by 3 pinned blocks (1.2 ms), 2 device segments, 0 retries" in format_run_timing(timing)
    timing["compiles"] = {"triton_kernels": 2.0, "compiled_frames": 0.0}
    assert "; compiled 2 Triton kernels and 0 torch.compile frames" in format_run_timing(timing)


def test_triton_compiles_are_counted_through_tritons_cache_hook(monkeypatch):
    """``bench`` counts each Triton kernel variant a run compiles (or loads from disk) with Triton's
    ``jit_cache_hook``, keeping a hook that was there before and its answer."""
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    from nanovllm_core import benchmark

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: seen.append(k) or False)
    before = benchmark.compile_counts()["triton_kernels"]
    assert benchmark.count_triton_compiles()
    assert knobs.runtime.jit_cache_hook(key="k", repr="kernel", fn=None) is False  # as Triton calls it on a miss
    assert benchmark.compile_counts()["triton_kernels"] == before + 1 and seen == [{"key": "k", "repr": "kernel",
                                                                                   "fn": None}]
    assert benchmark.count_triton_compiles()  # a second call counts nothing twice
    knobs.runtime.jit_cache_hook(key="k2", repr="kernel", fn=None)
    assert benchmark.compile_counts()["triton_kernels"] == before + 2 and len(seen) == 2
