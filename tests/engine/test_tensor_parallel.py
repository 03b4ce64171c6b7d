"""Tensor parallelism on CPU with gloo: TP=2 equals TP=1 and transformers; workers always go away."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.engine.parallel import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23] * 9, list(range(40, 110))]
ENGINE = dict(num_kvcache_blocks=48, kvcache_block_size=16, max_model_len=256)


def alive(processes):
    return [p for p in processes if p.is_alive()]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_tp2_matches_tp1_and_transformers(arch, qwen3_path, qwen2_path, hf_reference):
    # the qwen2 checkpoint has one KV head for two ranks: it is replicated
    path = {"qwen3": qwen3_path, "qwen2": qwen2_path}[arch]
    tp1 = LLM(str(path), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        tp2 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # preemption and chunked prefill under TP too
        small = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        processes = llm.tp_group.processes
        llm.shutdown()
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(tp2) == ids(tp1) == hf_reference(path, PROMPTS, 24)
    assert ids(small) == ids(tp1)
    assert not alive(processes)


def test_dead_worker_is_a_clear_error_not_a_hang(qwen3_path):
    llm = LLM(str(qwen3_path), tensor_parallel_size=2, **ENGINE)
    worker = llm.tp_group.processes[0]
    worker.kill()
    worker.join(10)
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker died: rank 1"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.shutdown()


def test_torchrun_two_processes(qwen3_path, tmp_path, hf_reference):
    script = tmp_path / "tp_torchrun.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os
            from nanovllm_core import LLM, SamplingParams

            llm = LLM({str(qwen3_path)!r}, tensor_parallel_size=2, num_kvcache_blocks=48,
                      kvcache_block_size=16, max_model_len=256)
            # only rank 0 gets here: the other rank served inside LLM() and exited
            outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
            print("RESULT", json.dumps([o.outputs[0].token_ids for o in outs]), os.environ["RANK"])
            llm.shutdown()
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOVLLM_TP_TIMEOUT": "60"}
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(lines) == 1
    rank = lines[0].rsplit(" ", 1)[1]
    tokens = json.loads(lines[0][len("RESULT ") :].rsplit(" ", 1)[0])
    assert rank == "0"
    assert tokens == hf_reference(qwen3_path, PROMPTS, 24)
