"""Tensor-parallel lifecycle: shutdown, deletion, interpreter exit, dead and stuck workers, Ctrl-C, the missing
main guard, and the process state left behind. Each test is bounded to seconds. Every test runs on CPU (gloo);
with two GPUs the same tests run over NCCL too (marked gpu)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import SHUTDOWN_LIMIT_S, assert_exited_cleanly, pid_running, timed_shutdown
from nanovllm_testing import GPU_TEST_SHAPE, write_tiny_checkpoint

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.engine.parallel import WorkerDiedError
from nanovllm_core.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23] * 9]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NANOVLLM_TP_TIMEOUT": "60"}


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
            ],
        ),
    ]
)
def target(request, qwen3_path, tmp_path_factory) -> tuple[Path, dict]:
    """(checkpoint, engine keyword arguments) for the device under test."""
    engine = dict(device=request.param, num_kvcache_blocks=48, kvcache_block_size=16, max_model_len=256)
    if request.param == "cpu":
        return qwen3_path, engine
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)
    return path, engine


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def wait_gone(processes, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in processes if p.is_alive()]


def write_script(tmp_path, target, body: str, guard: bool = True) -> Path:
    """A script that builds a TP=2 ``llm`` for ``target`` (under the main guard unless ``guard`` is False),
    then runs ``body``."""
    path, engine = target
    build = f"llm = LLM({str(path)!r}, tensor_parallel_size=2, **{engine!r})\n" + textwrap.dedent(body)
    if guard:
        build = 'if __name__ == "__main__":\n' + textwrap.indent(build, "    ")
    script = tmp_path / "script.py"
    script.write_text("import os, signal, threading, time\nfrom nanovllm_core import LLM, SamplingParams\n\n" + build)
    return script


def run_script(script: Path, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=ENV, **popen
    )


def test_with_block_shuts_down_fast_without_threads_and_restores_torch_threads(target, monkeypatch):
    path, engine = target
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # the engine sets its own count while it runs (cpu_count // 2 on CPU)
    try:
        with LLM(str(path), tensor_parallel_size=2, **engine) as llm:
            processes = llm.tp_group.processes
            assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))

            def refuse(self):  # as at interpreter exit on Python 3.12, where finalizers shut engines down
                raise RuntimeError("can't create new thread at interpreter shutdown")

            monkeypatch.setattr(threading.Thread, "start", refuse)
            start = time.monotonic()
        elapsed = time.monotonic() - start
        monkeypatch.undo()
        assert elapsed < SHUTDOWN_LIMIT_S
        assert not [p for p in processes if p.is_alive()]
        assert torch.get_num_threads() == 3
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(RuntimeError, match="the engine was shut down"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        torch.set_num_threads(before)


def test_deleted_engine_releases_its_workers_and_makes_room_for_the_next_one(target):
    path, engine = target
    llm = LLM(str(path), tensor_parallel_size=2, **engine)
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    workers = llm.tp_group.processes
    del llm  # no shutdown(), no gc.collect()
    assert not wait_gone(workers, SHUTDOWN_LIMIT_S)
    second = LLM(str(path), tensor_parallel_size=2, **engine)
    workers = second.tp_group.processes
    cycle = [second]
    cycle.append(cycle)
    del second, cycle  # unreachable, but only the garbage collector can tell: the next engine runs it
    third = LLM(str(path), tensor_parallel_size=2, **engine)
    try:
        assert not wait_gone(workers, SHUTDOWN_LIMIT_S)
        assert token_ids(third.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        # one process group per process: a second live engine is refused clearly, the first keeps working
        with pytest.raises(ConfigError, match="another tensor-parallel engine is still running"):
            LLM(str(path), tensor_parallel_size=2, **engine)
        assert token_ids(third.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        third.shutdown()


def test_stopped_worker_does_not_stall_shutdown(target):
    path, engine = target
    llm = LLM(str(path), tensor_parallel_size=2, **engine)
    worker = llm.tp_group.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)  # hung: it will never read the exit message
    assert timed_shutdown(llm) < SHUTDOWN_LIMIT_S
    assert not worker.is_alive()


def test_shutdown_while_another_thread_generates(target, capfd):
    """A server's shape: one thread steps the engine, another shuts it down. Shutdown is bounded, the workers
    go quietly, and the stepping thread gets a clear error instead of hanging."""
    path, engine = target
    llm = LLM(str(path), tensor_parallel_size=2, **engine)
    workers = llm.tp_group.processes
    errors: list[BaseException] = []

    def generate_until_stopped() -> None:
        try:
            while True:
                llm.generate([[5, 6, 7] * 10] * 4, LONG, use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            errors.append(exc)

    stepper = threading.Thread(target=generate_until_stopped)
    stepper.start()
    time.sleep(0.5)
    assert timed_shutdown(llm) < SHUTDOWN_LIMIT_S
    stepper.join(SHUTDOWN_LIMIT_S)
    assert not stepper.is_alive()
    assert errors and "the engine was shut down" in str(errors[0]), errors
    assert not [p for p in workers if p.is_alive()]
    assert "Traceback" not in capfd.readouterr().err  # a worker cut off mid-step by the shutdown is no failure


def test_worker_killed_mid_generate_is_reported_in_seconds(target):
    path, engine = target
    llm = LLM(str(path), tensor_parallel_size=2, **engine)
    worker = llm.tp_group.processes[0]
    killer = threading.Timer(0.3, os.kill, (worker.pid, signal.SIGKILL))
    died = r"tensor-parallel worker died: rank 1 \(exit code -9, killed by SIGKILL"
    # on CPU the step that loses the worker raises it; over NCCL that step may end in the backend's own error
    first_error = WorkerDiedError if engine["device"] == "cpu" else RuntimeError
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(first_error, match=died if first_error is WorkerDiedError else None):
            for _ in range(50):  # the kill lands in one of them
                llm.generate([[5, 6, 7] * 10] * 4, LONG, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerDiedError, match=died):  # and stays reported
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        killer.join()
        shutdown_s = timed_shutdown(llm)
    assert shutdown_s < SHUTDOWN_LIMIT_S


def test_interpreter_exit_without_shutdown_exits_zero_in_seconds(target, tmp_path):
    script = write_script(
        tmp_path,
        target,
        """
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        cycle = [llm]
        cycle.append(cycle)  # still referenced at exit: only the exit hook can stop the workers
        print("PIDS", *[p.pid for p in llm.tp_group.processes], flush=True)
        print("END", time.time(), flush=True)
        """,
    )
    proc = run_script(script)
    exited = time.time()
    assert_exited_cleanly(proc, exited)


def test_missing_main_guard_fails_fast_naming_the_guard(target, tmp_path):
    script = write_script(tmp_path, target, 'print("BUILT", flush=True)', guard=False)
    start = time.monotonic()
    proc = run_script(script, timeout=90)
    assert proc.returncode != 0
    assert "BUILT" not in proc.stdout
    assert "tensor-parallel worker rank 1 failed to start" in proc.stderr, proc.stderr[-3000:]
    assert 'if __name__ == "__main__":' in proc.stderr
    assert f"re-imported {script}" in proc.stderr
    assert time.monotonic() - start < 60  # start-up time of two interpreters, not NANOVLLM_TP_TIMEOUT


def test_ctrl_c_during_generate_then_generate_again(target, tmp_path):
    """SIGINT to rank 0 alone (a notebook's interrupt) and to the whole process group (a terminal's Ctrl-C),
    at several points of a generate: each time the engine comes back and greedy output is unchanged."""
    script = write_script(
        tmp_path,
        target,
        f"""
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            prompts = {PROMPTS!r}
            expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            for i, delay in enumerate([0.05, 0.2, 0.4, 0.1, 0.3, 0.6]):
                target = (os.kill, os.getpid()) if i % 2 == 0 else (os.killpg, os.getpgid(0))
                timer = threading.Timer(delay, target[0], (target[1], signal.SIGINT))
                timer.start()
                try:
                    while True:  # until the interrupt lands (a GPU finishes one generate quickly)
                        llm.generate([[5, 6, 7] * 10] * 4, long, use_tqdm=False)
                except KeyboardInterrupt:
                    pass
                timer.join()
                again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
                print("AGAIN", "same" if again == expected else "different", flush=True)
            llm.shutdown()
        """,
    )
    # its own process group, so that killpg reaches it and its worker only
    proc = run_script(script, timeout=150, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("AGAIN same") == 6, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("ending", ["ctrl-c", "rank0-killed"])
def test_script_that_dies_mid_generate_leaves_no_worker_behind(target, tmp_path, ending):
    """A terminal's Ctrl-C (SIGINT to the whole process group) in the middle of generation, not caught: the
    script ends with KeyboardInterrupt and its workers are gone. Rank 0 killed outright (SIGKILL, nothing
    runs on its side) while the workers wait for the next step: they notice and exit."""
    work = "while True:" if ending == "ctrl-c" else "for _ in range(0):"
    script = write_script(
        tmp_path,
        target,
        f"""
        print("PIDS", *[p.pid for p in llm.tp_group.processes], flush=True)
        {work}
            llm.generate([[5, 6, 7] * 20] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
        time.sleep(60)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=ENV,
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()[-2000:]
        workers = [int(pid) for pid in line.split()[1:]]
        time.sleep(1)  # mid-generation, or idle after a short one
        if ending == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=30)
            assert "KeyboardInterrupt" in proc.stderr.read()
        else:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + SHUTDOWN_LIMIT_S
    while any(pid_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    running = [pid for pid in workers if pid_running(pid)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert not running


def test_a_hung_leave_is_bounded(monkeypatch, caplog):
    """On two H200s the NCCL abort once hung on both ranks after a finished run; a rank now waits for its own
    leaving only so long, then goes on (a worker exits, rank 0's shutdown returns) and says why."""
    from nanovllm_core.engine import parallel

    release = threading.Event()
    monkeypatch.setattr(parallel, "leave_distributed", lambda device_type: release.wait(30))
    start = time.monotonic()
    with caplog.at_level("WARNING", logger=parallel.__name__):
        assert parallel.leave_distributed_within("cuda", 0.3) is False
    assert time.monotonic() - start < 2
    assert "did not finish within" in caplog.text and "NCCL" in caplog.text
    release.set()
    monkeypatch.setattr(parallel, "leave_distributed", lambda device_type: None)
    assert parallel.leave_distributed_within("cuda", 5) is True


def test_a_gloo_leave_finishes_before_it_returns(monkeypatch):
    """gloo's leave runs inline, however long it takes: a process that exits while a thread is still destroying
    its gloo group can abort in finalization."""
    from nanovllm_core.engine import parallel

    left = []
    monkeypatch.setattr(parallel, "leave_distributed", lambda device_type: (time.sleep(0.3), left.append(device_type)))
    assert parallel.leave_distributed_within("cpu", 0.01) is True
    assert left == ["cpu"]
    assert not [t for t in threading.enumerate() if t.name == "nanovllm-tp-leave"]


def test_at_interpreter_exit_the_leave_runs_inline_and_a_failure_stays_quiet(monkeypatch):
    """Where no thread can start (interpreter shutdown), the NCCL leave runs inline, as best effort as in its
    thread: what it raises is logged at debug level, not raised into the exit."""
    from nanovllm_core.engine import parallel

    def no_thread(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    def failing_leave(device_type):
        raise RuntimeError("NCCL communicator already aborted")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    monkeypatch.setattr(parallel, "leave_distributed", failing_leave)
    assert parallel.leave_distributed_within("cuda", 0.01) is True


def test_a_step_cut_off_by_shutdown_says_so():
    """The race behind test_shutdown_while_another_thread_generates, made certain: the step has passed the
    group's check, then the group is left under it and its collective fails with whatever the backend says.
    The stepping thread hears that the engine was shut down; any other failure passes through unchanged."""
    from nanovllm_core.engine.model_core import StepStats, _StepTimer

    class Group:
        closed = False

        def check(self) -> None:
            if self.closed:
                raise RuntimeError("the engine was shut down (its tensor-parallel workers are gone): create a new one")

    class Runner:
        def launch(self, batch, in_flight=None):
            raise ValueError("Default process group has not been initialized")

    group = Group()
    timer = _StepTimer(Runner(), StepStats(), group)
    with pytest.raises(ValueError, match="process group"):  # the group still open: not a shutdown
        timer.launch(None)
    group.closed = True
    with pytest.raises(RuntimeError, match="the engine was shut down") as caught:
        timer.launch(None)
    assert isinstance(caught.value.__context__, ValueError)
