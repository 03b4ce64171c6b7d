"""The all-reduce path chosen per message size (NCCL, or PyTorch symmetric memory when switched on) and
benchmarks/allreduce.py, which measures them. The symmetric-memory kernels need two CUDA devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.distributed import (
    ONE_SHOT_ENV,
    TWO_SHOT_ENV,
    SymmMemLimits,
    all_reduce_method,
    setup_symm_mem_all_reduce,
)
from nanovllm_core.errors import ConfigError

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_limits_come_from_the_environment_and_bad_values_are_named():
    assert not SymmMemLimits.from_env({}).enabled
    limits = SymmMemLimits.from_env({ONE_SHOT_ENV: "65536", TWO_SHOT_ENV: " 1048576 "})
    assert (limits.one_shot_max_bytes, limits.two_shot_max_bytes, limits.enabled) == (65536, 1048576, True)
    assert limits.buffer_bytes == 1048576
    for bad in ("64k", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"{ONE_SHOT_ENV}='{bad}'.*integer >= 0"):
            SymmMemLimits.from_env({ONE_SHOT_ENV: bad})


def test_each_size_takes_the_path_its_limits_give():
    limits = SymmMemLimits(one_shot_max_bytes=4096, two_shot_max_bytes=65536)
    bf16 = torch.bfloat16
    assert [limits.method(n, bf16) for n in (16, 4096, 4112, 65536, 65552)] == [
        "one_shot",
        "one_shot",
        "two_shot",
        "two_shot",
        "nccl",
    ]
    assert limits.method(1024, torch.float32) == "one_shot"
    assert limits.method(1024, torch.float16) == "nccl"  # the kernels sum bfloat16 and float32 only
    assert limits.method(1030, bf16) == "nccl"  # not a multiple of 16 bytes
    assert limits.method(1024, bf16, aligned=False) == "nccl"
    assert limits.method(0, bf16) == "nccl"
    assert SymmMemLimits(0, 65536).method(16, bf16) == "two_shot"


def test_one_rank_or_cpu_or_no_limits_keep_the_plain_path():
    assert all_reduce_method(torch.ones(4)) == "none"  # one rank: nothing to reduce
    assert setup_symm_mem_all_reduce(torch.device("cpu"), SymmMemLimits(4096, 0)) is None
    assert setup_symm_mem_all_reduce(torch.device("cpu"), SymmMemLimits()) is None


def run_benchmark(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARK), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_benchmark_without_gpus_says_so():
    proc = run_benchmark("--hidden", "1024", "--batch", "1", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert "needs 2 CUDA devices; this machine has 0" in proc.stderr


def test_benchmark_refuses_nvlink_multicast():
    proc = run_benchmark(NCCL_NVLS_ENABLE="1")
    assert proc.returncode != 0
    assert "NCCL_NVLS_ENABLE=1: this benchmark keeps NVLink multicast off" in proc.stderr


# --- two GPUs -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@two_gpus
def test_benchmark_sums_right_on_every_path(tmp_path):
    out = tmp_path / "allreduce.json"
    proc = run_benchmark(
        "--hidden", "1024,4096", "--batch", "1,16,256", "--iters", "20", "--repeats", "2", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    result = json.loads(out.read_text())
    assert result["symm_mem_error"] is None, result["symm_mem_error"]
    assert result["env"]["NCCL_NVLS_ENABLE"] == "0" and result["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert len(result["rows"]) == 6
    for row in result["rows"]:
        assert row["correct"] == {"nccl": True, "one_shot": True, "two_shot": True}, row
        assert all(row["us"][m][mode] > 0 for m in ("nccl", "one_shot", "two_shot") for mode in ("eager", "graph"))


@pytest.mark.gpu
@two_gpus
def test_tp2_symm_mem_all_reduce_equals_nccl(monkeypatch, tmp_path_factory):
    """TP=2 with decode-sized messages through one-shot, prompt chunks through two-shot and the largest through
    NCCL (CUDA graphs on, capturing the symmetric-memory kernels): the tokens of NCCL alone (with two ranks
    every path adds the same two numbers)."""
    import gc

    from nanovllm_testing import GPU_TEST_SHAPE, write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("symm_bf16"), "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)
    engine = dict(max_model_len=1024, num_kvcache_blocks=64, kvcache_block_size=256, max_num_seqs=32)
    prompts = [[(7 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 33, 130, 260, 900])]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run() -> tuple[list[list[int]], list[str]]:
        with LLM(str(path), tensor_parallel_size=2, **engine) as llm:
            assert llm.runner.graphs is not None
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            probe = [torch.empty((rows, 256), dtype=torch.bfloat16, device="cuda") for rows in (8, 256, 1024)]
            methods = [all_reduce_method(t) for t in probe]
        gc.collect()
        torch.cuda.empty_cache()
        return [o.outputs[0].token_ids for o in outs], methods

    monkeypatch.delenv(ONE_SHOT_ENV, raising=False)
    monkeypatch.delenv(TWO_SHOT_ENV, raising=False)
    want, methods = run()
    assert methods == ["nccl"] * 3
    monkeypatch.setenv(ONE_SHOT_ENV, str(32 * 256 * 2))  # a decode step of up to 32 rows
    monkeypatch.setenv(TWO_SHOT_ENV, str(512 * 256 * 2))  # the workers read the same settings (inherited)
    got, methods = run()
    assert methods == ["one_shot", "two_shot", "nccl"]
    assert got == want


def load_benchmark():
    from nanovllm_testing.scripts import load_script

    return load_script(BENCHMARK)


def row(nbytes: int, nccl: float, one: float, two: float, correct: bool = True) -> dict:
    us = {m: {"eager": t + 5, "graph": t} for m, t in (("nccl", nccl), ("one_shot", one), ("two_shot", two))}
    return {"batch": nbytes // 2048, "hidden": 1024, "bytes": nbytes, "us": us,
            "correct": {"nccl": True, "one_shot": correct, "two_shot": True}}  # fmt: skip


def test_benchmark_suggests_the_sizes_each_path_wins(capsys):
    bench = load_benchmark()
    rows = [row(2048, 20, 6, 9), row(32768, 21, 8, 9), row(262144, 25, 14, 12), row(4194304, 60, 90, 70)]
    assert bench.suggest(rows) == {"one_shot": 32768, "two_shot": 262144}
    assert bench.suggest(rows[3:]) == {"one_shot": 0, "two_shot": 0}  # NCCL wins: nothing switched
    # a path whose sum was wrong is never suggested
    assert bench.suggest([row(2048, 20, 6, 9, correct=False)]) == {"one_shot": 0, "two_shot": 2048}
    result = dict(rows=rows, world_size=2, device="GPU", dtype="bfloat16", torch="x", nccl="y", p2p=True)
    result.update(symm_mem_error=None, suggested=bench.suggest(rows))
    bench.print_table(result)
    out = capsys.readouterr().out
    assert "NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES=32768 NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES=262144" in out
    assert "4096 x 1024" not in out and "2048 x 1024" in out  # rows as batch x hidden
