"""The throughput bound `nanovllm bench` reports: the additive form and the per-step form by hand, and how it
follows the configuration (KV cache dtype, weight dtype, quantized weights, tensor-parallel size)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from nanovllm_bench.bound import bound_seconds, fit_decode_steps, model_cost

from nanovllm_core.errors import ConfigError

CONFIG = SimpleNamespace(
    num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=16, vocab_size=32,
)
MATMUL_PARAMS = 2 * (8 * 4 * 16 + 2 * 16 * 8 + 3 * 8 * 16) + 32 * 8  # layers x (qkv + o + mlp) + LM head
KV_PER_TOKEN = 2 * 2 * 1 * 16 * 2  # k and v, layers, kv heads, head_dim, bf16 bytes
FP8_KV_PER_TOKEN = 2 * 2 * 1 * (16 + 4)  # one byte an element and a float32 scale per (token, KV head)
RATES = {"copy_bytes_per_s": 1000.0, "gemm_flop_per_s": 1e6}


def one_sequence_per_step_bound(matmul_params: int, weight_bytes: int, kv_per_token: int) -> float:
    """Prompt of 3 tokens, 3 output tokens: the prefill gives the first, two decode steps read 4 and 5 tokens."""
    bandwidth, gemm = RATES["copy_bytes_per_s"], RATES["gemm_flop_per_s"]
    prompt_flops = 2 * matmul_params * 3 + 2 * 2 * 2 * 2 * 16 * 9 / 2  # matmuls, causal QK^T and PV of 3 tokens
    expected = max(prompt_flops / gemm, 3 * kv_per_token / bandwidth)
    for read in (4, 5):  # each decode step writes one token and reads the context
        step_bytes = weight_bytes + kv_per_token * (read + 1)
        expected += max(step_bytes / bandwidth, 2 * matmul_params / gemm)
    return expected


def test_one_sequence_by_hand():
    cost = model_cost(CONFIG, torch.bfloat16)
    assert (cost.matmul_params, cost.weight_bytes, cost.kv_bytes_per_token) == (
        MATMUL_PARAMS, 2 * MATMUL_PARAMS, KV_PER_TOKEN
    )
    b = bound_seconds(cost, [[0, 1, 2]], [3], RATES)
    weight_bytes = 2 * MATMUL_PARAMS
    # the additive form: reads of 4 + 5 tokens, writes of the prompt and every output token
    assert b["bytes_moved"] == KV_PER_TOKEN * (4 + 5) + KV_PER_TOKEN * (3 + 3) + 2 * weight_bytes
    prompt_flops = 2 * MATMUL_PARAMS * 3 + 2 * 2 * 2 * 2 * 16 * 9 / 2
    assert b["flops"] == pytest.approx(prompt_flops + 2 * MATMUL_PARAMS * 3)
    assert b["bound_s"] == pytest.approx(b["bytes_moved"] / 1000.0 + b["flops"] / 1e6)
    expected = one_sequence_per_step_bound(MATMUL_PARAMS, weight_bytes, KV_PER_TOKEN)
    assert b["per_step_bound_s"] == pytest.approx(expected)


def test_fp8_kv_is_half_the_bytes_plus_a_float32_scale_per_token_and_kv_head():
    bf16, fp8 = model_cost(CONFIG, torch.bfloat16), model_cost(CONFIG, torch.bfloat16, "fp8")
    scales = 2 * 1 * 4  # k and v, one KV head, a float32 each, per layer
    assert fp8.kv_bytes_per_token_per_layer == bf16.kv_bytes_per_token_per_layer // 2 + scales == 40
    assert fp8.kv_bytes_per_token == FP8_KV_PER_TOKEN
    assert model_cost(CONFIG, torch.bfloat16, "fp8_e4m3").kv_bytes_per_token == FP8_KV_PER_TOKEN  # vLLM's name
    assert fp8.weight_bytes == bf16.weight_bytes  # the cache's dtype leaves the weights as they are
    b16, b8 = bound_seconds(bf16, [[0, 1, 2]], [3], RATES), bound_seconds(fp8, [[0, 1, 2]], [3], RATES)
    tokens_moved = (4 + 5) + (3 + 3)  # KV reads and writes of the one sequence
    assert b16["bytes_moved"] - b8["bytes_moved"] == (KV_PER_TOKEN - FP8_KV_PER_TOKEN) * tokens_moved
    assert b8["memory_s"] < b16["memory_s"] and b8["compute_s"] == b16["compute_s"]
    expected = one_sequence_per_step_bound(MATMUL_PARAMS, 2 * MATMUL_PARAMS, FP8_KV_PER_TOKEN)
    assert b8["per_step_bound_s"] == pytest.approx(expected)
    assert b8["per_step_bound_s"] < b16["per_step_bound_s"]  # these decode steps are memory-bound at RATES


def test_weight_bytes_follow_the_weight_dtype():
    fp32 = model_cost(CONFIG, torch.float32)
    assert fp32.weight_bytes == 4 * MATMUL_PARAMS and fp32.kv_bytes_per_token == 2 * KV_PER_TOKEN
    assert model_cost(CONFIG, torch.float32, "fp8").kv_bytes_per_token == FP8_KV_PER_TOKEN  # whatever the model's
    assert "weights fp32" in fp32.describe() and "KV fp32 (128 bytes/token/layer)" in fp32.describe()
    with pytest.raises(ConfigError, match="weight dtype torch.int8: the bound knows"):
        model_cost(CONFIG, torch.int8)


def test_quantized_weights_count_their_bits_in_the_decoder_layers_and_the_lm_head_in_the_weight_dtype():
    lm_head = 32 * 8
    fp8 = model_cost(CONFIG, torch.bfloat16, quantization="fp8", quantized_weight_bits=8)
    assert fp8.weight_bytes == (MATMUL_PARAMS - lm_head) + 2 * lm_head
    assert fp8.matmul_params == MATMUL_PARAMS  # the same FLOPs
    assert "weights fp8 (LM head bf16)" in fp8.describe()
    assert model_cost(CONFIG, torch.bfloat16).weight_bytes == 2 * MATMUL_PARAMS


def test_tensor_parallel_counts_one_gpus_share():
    config = SimpleNamespace(**{**vars(CONFIG), "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 33})
    one, two = model_cost(config, torch.bfloat16), model_cost(config, torch.bfloat16, tensor_parallel_size=2)
    # per GPU: 2 query heads, 1 KV head, half the MLP, ceil(33 / 2) rows of the LM head
    assert two.matmul_params == 2 * (8 * (2 + 2) * 16 + 2 * 16 * 8 + 3 * 8 * 8) + 17 * 8
    assert one.matmul_params == 2 * (8 * (4 + 4) * 16 + 4 * 16 * 8 + 3 * 8 * 16) + 33 * 8
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.num_heads == 2 and "TP 2" in two.describe()
    b1, b2 = bound_seconds(one, [[0, 1, 2]], [3], RATES), bound_seconds(two, [[0, 1, 2]], [3], RATES)
    assert b2["per_step_bound_s"] < b1["per_step_bound_s"] and b2["weight_bytes"] == 2 * two.matmul_params
    # more GPUs than KV heads: each holds a replica of one KV head
    four = model_cost(config, torch.bfloat16, "fp8", tensor_parallel_size=4)
    assert four.num_kv_heads == 1 and four.kv_bytes_per_token_per_layer == 2 * (16 + 4)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        model_cost(config, torch.bfloat16, tensor_parallel_size=3)


def test_the_bound_says_which_configuration_it_counts():
    fp8 = model_cost(CONFIG, torch.bfloat16, "fp8")
    assert fp8.describe() == "KV fp8 e4m3 + fp32 scales (40 bytes/token/layer), weights bf16 (0.00 GiB a GPU), TP 1"
    assert model_cost(CONFIG, torch.bfloat16).describe().startswith("KV bf16 (64 bytes/token/layer), weights bf16")
    # a backend whose fp8 layout differs: the running cache's bytes, its scale size read back from them
    other = model_cost(CONFIG, torch.bfloat16, "fp8", kv_bytes_per_token_per_layer=2 * (16 + 2))
    assert other.kv_bytes_per_token == 2 * 36 and "fp8 e4m3 + 2-byte scales (36 bytes" in other.describe()
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int4': the bound knows 'auto', 'fp8' and 'fp8_e4m3'"):
        model_cost(CONFIG, torch.bfloat16, "int4")


@pytest.mark.parametrize("gemm", [1e3, 1e6, 1e12])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_per_step_form_is_never_above_the_sum(gemm, kv_cache_dtype):
    prompts = [[1] * n for n in (5, 1, 9, 3)]
    cost = model_cost(CONFIG, torch.bfloat16, kv_cache_dtype)
    b = bound_seconds(cost, prompts, [4, 1, 7, 2], {"copy_bytes_per_s": 1e4, "gemm_flop_per_s": gemm})
    assert 0 < b["per_step_bound_s"] <= b["bound_s"] + 1e-12


def test_decode_step_fit_recovers_the_parts():
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
    from nanovllm_bench.probes import profile_sizes

    assert profile_sizes("", 256) == [256]
    assert profile_sizes("16, 64,256", 256) == [16, 64, 256]
    for bad in ("0", "300", "16,x", "-4"):
        with pytest.raises(ConfigError, match=r"--profile-seqs .*from 1 to --num-seqs \(256\)"):
            profile_sizes(bad, 256)


def bench_argv(tmp_path, *extra: str) -> list[str]:
    return ["bench", "--shape", "tiny", "--num-seqs", "2", "--max-input-len", "100", "--max-output-len", "100",
            "--runs", "1", "--warmup-prompts", "0", "--device", "cpu", "--json", str(tmp_path / "bench.json"), *extra]


def test_a_config_file_without_a_model_runs_on_the_random_weights(tmp_path):
    """`nanovllm bench --config F` where F sets plugins but no model: the bench's random checkpoint, the file's
    plugins (it was refused with 'model: Field required')."""
    from nanovllm_core.cli import main

    config = tmp_path / "bench.toml"
    config.write_text('[plugins]\nattention = "torch"\n')
    assert main(bench_argv(tmp_path, "--config", str(config))) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["model"].startswith("/tmp/nanovllm-bench-tiny") and result["attention"] == "torch"
    assert "bound_s" not in result  # no device rates on the CPU, so no bound
    assert result["programmatic_dependent_launch"] is False  # the setting is on; a CPU has no such launch


def test_bench_counts_the_running_cache_in_its_bound(tmp_path, monkeypatch, capsys):
    """With device rates (given here: the CPU has none), `nanovllm bench --kv-cache-dtype fp8` bounds the run with
    the fp8 cache's bytes, and says so."""
    from nanovllm_bench import offline

    from nanovllm_core.cli import main

    monkeypatch.setattr(offline, "measure_device", lambda device, sustained_gemm_s=0.0: dict(RATES))
    assert main(bench_argv(tmp_path, "--attention", "torch", "--kv-cache-dtype", "fp8")) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    # the tiny shape: 2 layers, 2 KV heads of 32; fp8 values and a float32 scale per (token, KV head)
    assert result["kv_bytes_per_token"] == 2 * 2 * 2 * (32 + 4)
    assert result["bound_config"].startswith("KV fp8 e4m3 + fp32 scales (144 bytes/token/layer), weights fp32")
    assert result["bound_config"].endswith("TP 1")
    out = capsys.readouterr().out
    assert "Bound: per-step, KV fp8 e4m3 + fp32 scales (144 bytes/token/layer)" in out
    assert result["percent_of_per_step_bound"] == pytest.approx(100 * result["per_step_bound_s"] / result["seconds"])


def test_run_step_timing_splits_prompt_and_decode_steps_and_names_the_slowest():
    from nanovllm_bench.probes import format_run_timing, run_step_timing

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
    from nanovllm_bench import probes

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: seen.append(k) or False)
    before = probes.compile_counts()["triton_kernels"]
    assert probes.count_triton_compiles()
    assert knobs.runtime.jit_cache_hook(key="k", repr="kernel", fn=None) is False  # as Triton calls it on a miss
    assert probes.compile_counts()["triton_kernels"] == before + 1 and seen == [{"key": "k", "repr": "kernel",
                                                                                "fn": None}]
    assert probes.count_triton_compiles()  # a second call counts nothing twice
    knobs.runtime.jit_cache_hook(key="k2", repr="kernel", fn=None)
    assert probes.compile_counts()["triton_kernels"] == before + 2 and len(seen) == 2


def test_loading_the_plugins_imports_none_of_the_measurement_code():
    """The measurement code stays out of the engine's path: every engine process loads the plugins, which imports
    this distribution's entry point and the command classes it registers, and nothing more of it (nor the CLI)."""
    import subprocess
    import sys

    code = (
        "import sys; from nanovllm_core.plugins import build_registry; registry = build_registry()\n"
        "assert registry.registrations['command']['bench'].distribution == 'nanovllm-bench'\n"
        "print(sorted(m for m in sys.modules if m.startswith(('nanovllm_bench', 'nanovllm_core.cli'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['nanovllm_bench', 'nanovllm_bench.commands', 'nanovllm_bench.plugin']"
