"""Tensor parallelism on CPU with gloo: TP=2 equals TP=1 and transformers; workers always go away."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

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


def test_workers_exit_when_engine_is_deleted(qwen3_path):
    llm = LLM(str(qwen3_path), tensor_parallel_size=2, **ENGINE)
    processes = llm.tp_group.processes
    assert len(alive(processes)) == 1
    del llm
    gc.collect()
    deadline = time.time() + 20
    while alive(processes) and time.time() < deadline:
        time.sleep(0.1)
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


def test_ctrl_c_leaves_no_worker_behind(qwen3_path, tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, in the middle of generation."""
    import signal

    script = tmp_path / "ctrl_c.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from nanovllm_core import LLM, SamplingParams

            if __name__ == "__main__":
                llm = LLM({str(qwen3_path)!r}, tensor_parallel_size=2, num_kvcache_blocks=48,
                          kvcache_block_size=16, max_model_len=256)
                print("PIDS", " ".join(str(p.pid) for p in llm.tp_group.processes), flush=True)
                while True:
                    llm.generate([[5, 6, 7] * 20] * 4, SamplingParams(max_tokens=200, ignore_eos=True),
                                 use_tqdm=False)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = ""
        deadline = time.time() + 120
        while not line.startswith("PIDS") and time.time() < deadline:
            line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()[-2000:]
        workers = [int(pid) for pid in line.split()[1:]]
        time.sleep(2)  # mid-generation
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return "zombie" not in f.read()
        except FileNotFoundError:
            return False

    deadline = time.time() + 20
    while any(running(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if running(pid)]


def test_farewell_runs_inline_when_no_thread_can_start(monkeypatch):
    """At interpreter exit (where ``weakref.finalize`` closes the group) Python 3.12 refuses new threads: the
    shutdown steps must still run, in the calling thread."""
    import threading

    from nanovllm_core.engine import parallel

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    calls = []
    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert parallel._within(lambda: calls.append("ran"), 1)
    assert calls == ["ran"]
    assert not parallel._within(lambda: 1 / 0, 1)  # a failing step reports False, raises nothing
