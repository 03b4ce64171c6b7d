"""Data parallelism (``data_parallel_size``): replicas in processes of their own behind one ``LLM`` (and behind
``AsyncLLM``), both through :class:`DataParallelClient`. On CPU every replica is a process; the GPU cases are marked."""

from __future__ import annotations

import asyncio
import dataclasses
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
from engine_helpers import (
    GREEDY,
    PROMPTS,
    SHUTDOWN_LIMIT_S,
    assert_exited_cleanly,
    make_prompts,
    pid_running,
    timed_shutdown,
)
from nanovllm_data_parallel.client import DataParallelClient, combine_stats, plan_replicas
from nanovllm_testing import GPU_TEST_SHAPE, write_tiny_checkpoint

from nanovllm_core import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from nanovllm_core.engine.core import EngineStats
from nanovllm_core.engine.parallel import PORT_ENV
from nanovllm_core.entrypoints import llm as llm_module

ENGINE = dict(device="cpu", num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=256)
MIXED = PROMPTS + make_prompts(1, [9, 30, 55, 80, 100, 11]) + ["Hello world!", "The quick brown fox"]
LONG = SamplingParams(max_tokens=220, ignore_eos=True)


@pytest.fixture(scope="module")
def single(qwen3_path):
    return LLM(str(qwen3_path), **ENGINE)


@pytest.fixture(scope="module")
def want_mixed(single):
    """One engine's greedy outputs of MIXED."""
    return single.generate(MIXED, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def dp(qwen3_path):
    llm = LLM(str(qwen3_path), data_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(pid_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_running(p)]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            found += children
            todo += children
    return found


def assert_idle(stats: EngineStats) -> None:
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# --- one LLM, two replicas -----------------------------------------------------------------------------------


def test_outputs_equal_one_engine_token_for_token_and_the_load_is_split(dp, single, want_mixed):
    assert isinstance(dp.engine_client, DataParallelClient) and dp.config.data_parallel_size == 2
    before = dp.replica_stats()
    outs = dp.generate(MIXED, GREEDY, use_tqdm=False)
    ref = want_mixed
    assert token_ids(outs) == token_ids(ref)
    assert [o.request_id for o in outs] == [f"generate-{i}" for i in range(len(MIXED))]
    assert [(o.prompt, o.prompt_token_ids) for o in outs] == [(o.prompt, o.prompt_token_ids) for o in ref]
    assert outs[-1].prompt == "The quick brown fox" and all(o.error is None for o in outs)
    after = dp.replica_stats()
    done = [a.num_finished_requests - b.num_finished_requests for a, b in zip(after, before)]
    prompt_tokens = [a.num_prompt_tokens - b.num_prompt_tokens for a, b in zip(after, before)]
    assert sum(done) == len(MIXED) and min(done) >= len(MIXED) // 3, done
    # placed by work (prompt + max_tokens, largest first): each replica computes a fair share of the prompts
    assert min(prompt_tokens) >= 0.35 * sum(prompt_tokens), prompt_tokens
    combined = dp.stats()
    assert combined == combine_stats(after)
    assert combined.num_kv_blocks == 2 * ENGINE["num_kvcache_blocks"]
    assert_idle(combined)
    assert dp.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
        single.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_text_stop_strings_logprobs_and_n_equal_one_engine_and_stopped_requests_leave_the_replicas(dp, single):
    """The front-end's output processor makes the text over the replicas' token ids: stop strings (the request is
    aborted in its replica, which would otherwise run on to max_tokens), logprob dicts' tokens, n samples."""
    text = single.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    # stop strings of whole characters, each first found where it is taken from
    at = [i for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i]
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    params = [
        dataclasses.replace(long, stop=[text[at[1] : at[1] + 3]], logprobs=2),
        dataclasses.replace(long, stop=[text[at[0] : at[0] + 3]], include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]

    def seen(outs):
        return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]

    want = single.generate(prompts, params, use_tqdm=False)
    got = dp.generate(prompts, params, use_tqdm=False)
    assert seen(got) == seen(want)
    # logprob values differ in the last bits with the batch a replica computes them in: compared apart
    got_lp, want_lp = got[0].outputs[0], want[0].outputs[0]
    assert got_lp.cumulative_logprob == pytest.approx(want_lp.cumulative_logprob, abs=1e-3)
    assert [{t: (lp.rank, lp.decoded_token) for t, lp in p.items()} for p in got_lp.logprobs] == [
        {t: (lp.rank, lp.decoded_token) for t, lp in p.items()} for p in want_lp.logprobs
    ]
    assert [c.finish_reason for c in got[0].outputs + got[1].outputs] == ["stop", "stop"]
    assert got[1].outputs[0].text == text[: at[0] + 3] and got[0].outputs[0].text == text[: at[1]]
    assert all(lp.decoded_token is not None for p in got[0].outputs[0].logprobs for lp in p.values())
    assert_idle(dp.stats())  # the aborts went to the replicas before this call did


def assert_metrics_at_the_stop(out) -> None:
    """A request a stop string ended: its metrics as they stood at the match, as an engine in this process gives."""
    m, c = out.metrics, out.outputs[0]
    assert c.finish_reason == "stop" and m is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
    assert m.num_generation_tokens == len(c.token_ids) and m.num_prompt_tokens == len(out.prompt_token_ids)


def test_a_request_a_stop_string_ended_keeps_its_metrics(dp, single):
    """Streamed outputs cross from a replica without metrics; the front-end ends the request on its stop string and
    gives its output with the metrics the abort brings back, counted up to the match (the replica ran on)."""
    text = single.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    at = next(i for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[text[at : at + 3]])
    want, got = (llm.generate([PROMPTS[0]], params, use_tqdm=False)[0] for llm in (single, dp))
    assert (got.outputs[0].text, got.outputs[0].token_ids) == (want.outputs[0].text, want.outputs[0].token_ids)
    assert_metrics_at_the_stop(want)
    assert_metrics_at_the_stop(got)
    counts = [(o.metrics.num_generation_tokens, o.metrics.num_prompt_tokens) for o in (got, want)]
    assert counts[0] == counts[1]
    assert_idle(dp.stats())


def test_bad_prompts_get_error_outputs_and_the_others_complete(dp, single):
    prompts = ["", [1, 10**7], [5] * 300, "Hello world!", {"text": "x"}, PROMPTS[1], PROMPTS[2]]
    params = [GREEDY] * len(prompts)
    params[6] = {"max_tokens": 3}  # not a SamplingParams
    outs = dp.generate(prompts, params, use_tqdm=False)
    errors = [o.error for o in outs]
    assert "empty" in errors[0]
    assert "outside the vocabulary" in errors[1]
    assert "max_model_len" in errors[2]
    assert "'prompt' (text) or 'prompt_token_ids'" in errors[4] and "not 'text'" in errors[4]
    assert "sampling_params must be a SamplingParams" in errors[6]
    assert all(outs[i].outputs[0].finish_reason == "error" for i in (0, 1, 2, 4, 6))
    good = [3, 5]
    assert [errors[i] for i in good] == [None, None]
    assert token_ids([outs[i] for i in good]) == token_ids(
        single.generate([prompts[i] for i in good], GREEDY, use_tqdm=False)
    )
    assert_idle(dp.stats())


class Interrupted(Exception):
    pass


class FailingBar:
    """A progress bar whose first update raises: generate fails while most of its requests still run."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def update(self, n: int = 1) -> None:
        raise Interrupted

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_exception_mid_generate_leaves_nothing_queued(dp, want_mixed, monkeypatch):
    prompts = [[5, 6, 7]] + [[20 + i, 21, 22] * 8 for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)] + [LONG] * 6
    before = dp.stats()
    monkeypatch.setattr(llm_module, "tqdm", FailingBar)
    with pytest.raises(Interrupted):
        dp.generate(prompts, params)
    monkeypatch.undo()
    after = dp.stats()  # the replicas took the aborts before this question
    assert_idle(after)
    assert after.num_generation_tokens - before.num_generation_tokens < 6 * LONG.max_tokens
    # no output of the aborted call leaks into the next one
    assert token_ids(dp.generate(MIXED, GREEDY, use_tqdm=False)) == token_ids(want_mixed)


def test_add_request_step_and_abort(dp, single):
    long_id = dp.add_request([5, 6, 7] * 10, LONG)
    dp.add_request("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="short")
    with pytest.raises(InvalidRequestError, match="already in use"):
        dp.add_request([1, 2], request_id="short")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        dp.add_request([1, 10**7])
    with pytest.raises(InvalidRequestError, match="priority='high' is invalid"):
        dp.add_request([1, 2], priority="high")
    with pytest.raises(InvalidRequestError, match="still unfinished"):
        dp.generate(["Hello"], use_tqdm=False)
    assert dp.num_unfinished_requests == 2
    done = []
    while not any(o.request_id == "short" for o in done):
        done += dp.step()
    short = next(o for o in done if o.request_id == "short")
    assert short.prompt == "Hello" and short.prompt_token_ids == dp.tokenizer.encode("Hello")
    want = single.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert short.outputs[0].token_ids == want[0].outputs[0].token_ids
    urgent = dp.add_request("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), priority=-1)
    while not any(o.request_id == urgent for o in done):
        done += dp.step()
    assert next(o for o in done if o.request_id == urgent).outputs[0].token_ids == want[0].outputs[0].token_ids
    # the replicas step on their own while this thread pulls: on a loaded machine the first long request may have
    # finished by now (its final output then came through step()); one added now cannot have
    first = dp.abort_request(long_id)
    if first is None:
        assert next(o for o in done if o.request_id == long_id).outputs[0].finish_reason == "length"
    else:  # aborted, or finished and not pulled yet
        assert first.finished and first.outputs[0].finish_reason in ("abort", "length")
    long_id = dp.add_request([5, 6, 7] * 10, LONG)
    aborted = dp.abort_request(long_id)
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) < LONG.max_tokens
    assert dp.abort_request(long_id) is None and dp.abort_request("unknown") is None
    assert not dp.has_unfinished_requests() and dp.step() == []
    assert_idle(dp.stats())


def test_what_lives_inside_one_engine_says_it_is_not_available(dp):
    for name in ("runner", "scheduler", "step_stats", "tp_group", "block_manager"):
        with pytest.raises(AttributeError, match="not available with data_parallel_size > 1"):
            getattr(dp, name)
    assert type(dp) is LLM  # the same class, holding another client


def test_combine_stats_sums_counters_and_rates_over_all_blocks_and_queries():
    a = EngineStats(1, 2, 100, 50, 3, 10, 5, 40, 7, 1)
    b = EngineStats(4, 0, 300, 300, 0, 30, 0, 60, 3, 2)
    both = combine_stats([a, b])
    assert (both.num_running, both.num_waiting, both.num_kv_blocks, both.num_free_kv_blocks) == (5, 2, 400, 350)
    assert both.kv_cache_usage == pytest.approx(50 / 400)  # not the mean of 0.5 and 0.0
    assert both.prefix_cache_hit_rate == pytest.approx(5 / 40)
    assert (both.num_prompt_tokens, both.num_generation_tokens, both.num_finished_requests) == (100, 10, 3)

    @dataclasses.dataclass
    class Named:
        name: str
        count: int

    assert combine_stats([Named("x", 1), Named("x", 2)]) == Named("x", 3)
    with pytest.raises(TypeError, match="Named.name"):
        combine_stats([Named("x", 1), Named("y", 2)])


# --- configuration and placement ------------------------------------------------------------------------------


def test_config_flag_and_placement(qwen3_path, tmp_path, monkeypatch):
    from nanovllm_core.cli import build_parser, cli_overrides
    from nanovllm_core.engine.config_resolver import load_config

    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig.load(overrides={"model": "m", "data_parallel_size": 0})
    args = build_parser().parse_args(["generate", "--model", "m", "--data-parallel-size", "2"])
    assert cli_overrides(args)["data_parallel_size"] == 2
    toml = tmp_path / "dp.toml"
    toml.write_text("data_parallel_size = 3\n")
    assert load_config(str(qwen3_path), toml, None, {}).data_parallel_size == 3
    assert load_config(str(qwen3_path), toml, {"data_parallel_size": 1}, {}).data_parallel_size == 1
    assert load_config(str(qwen3_path), None, None, {}).data_parallel_size == 1
    cpu = plan_replicas(EngineConfig.load(overrides={"model": "m", "device": "cpu", "data_parallel_size": 2}))
    assert [p.where for p in cpu] == ["CPU", "CPU"] and cpu[0].threads == max(1, (os.cpu_count() or 1) // 2)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpus = EngineConfig.load(overrides={"model": "m", "data_parallel_size": 2, "tensor_parallel_size": 2})
    placed = plan_replicas(gpus)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placed] == ["4,5", "6,7"]
    assert placed[0].env[PORT_ENV] != placed[1].env[PORT_ENV]  # each replica's tensor-parallel group its own port
    assert [p.where for p in placed] == ["GPUs 4,5", "GPUs 6,7"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs; .* sees 3"):
        plan_replicas(gpus)


def test_cli_generate_with_two_replicas_and_no_process_left(qwen3_path, capsys):
    """``nanovllm generate --data-parallel-size 2``; the command never calls shutdown(): its LLM goes when the
    command returns (the last reference dropped, as ``del llm``), and its replicas with it."""
    from nanovllm_core.cli import main

    before = set(descendants(os.getpid()))
    flags = ["--num-kvcache-blocks", "32", "--kvcache-block-size", "16", "--max-model-len", "256"]
    argv = ["generate", "--model", str(qwen3_path), "--device", "cpu", "--data-parallel-size", "2", *flags]
    assert main([*argv, "--max-tokens", "4", "--no-progress", "--prompt", "Hello", "--prompt", "To be"]) == 0
    out = capsys.readouterr().out
    assert out.count("(4 tokens, length)") == 2 and "2 data-parallel replicas" in out
    assert not wait_gone(sorted(set(descendants(os.getpid())) - before), SHUTDOWN_LIMIT_S)


# --- life cycle ---------------------------------------------------------------------------------------------


def test_with_block_shuts_down_fast_and_leaves_no_process(qwen3_path):
    with LLM(str(qwen3_path), data_parallel_size=2, **ENGINE) as llm:
        pids = [p.pid for p in llm.replica_processes]
        assert len(set(pids)) == 2 and all(pid_running(p) for p in pids)
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        start = time.monotonic()
    assert time.monotonic() - start < SHUTDOWN_LIMIT_S
    assert not [p for p in pids if pid_running(p)]
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()  # twice is fine


def test_a_dead_replica_fails_the_call_with_its_name_and_a_hung_one_does_not_stall_shutdown(qwen3_path):
    llm = LLM(str(qwen3_path), data_parallel_size=2, **ENGINE)
    hung, victim = llm.replica_processes
    os.kill(hung.pid, signal.SIGSTOP)  # it will never read the stop
    killer = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"data-parallel replica 1 \(CPU\) failed: the engine process exited"):
            for _ in range(100):  # the kill lands in one of them
                llm.generate([[5, 6, 7] * 10] * 4, LONG, use_tqdm=False)
        with pytest.raises(RuntimeError, match="cannot continue: data-parallel replica 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        killer.join()
        shutdown_s = timed_shutdown(llm)
    assert shutdown_s < SHUTDOWN_LIMIT_S
    assert not wait_gone([hung.pid, victim.pid], 1.0)


SCRIPT = """
import os, sys, time
from nanovllm_core import LLM, SamplingParams

def main():
    llm = LLM(sys.argv[1], data_parallel_size=2, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16,
              max_model_len=256)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
    cycle = [llm]
    cycle.append(cycle)  # still referenced at exit: only the exit hooks can stop the replicas
    print("PIDS", *[p.pid for p in llm.replica_processes], flush=True)
    print("END", time.time(), flush=True)
"""


def run_script(tmp_path, body: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_interpreter_exit_without_shutdown_exits_zero_and_leaves_no_process(qwen3_path, tmp_path):
    proc = run_script(tmp_path, SCRIPT + 'if __name__ == "__main__":\n    main()\n', str(qwen3_path))
    exited = time.time()
    assert_exited_cleanly(proc, exited)


def test_missing_main_guard_fails_fast_naming_the_guard(qwen3_path, tmp_path):
    start = time.monotonic()
    proc = run_script(tmp_path, SCRIPT + "main()\n", str(qwen3_path), timeout=90)
    assert proc.returncode != 0
    assert "PIDS" not in proc.stdout
    assert "data-parallel replica 0 (CPU) failed to start" in proc.stderr, proc.stderr[-3000:]
    assert 'if __name__ == "__main__":' in proc.stderr
    assert time.monotonic() - start < 60


# --- with tensor parallelism, and behind AsyncLLM --------------------------------------------------------------


def test_two_replicas_of_two_tensor_parallel_ranks_on_cpu(qwen3_path, want_mixed):
    llm = LLM(str(qwen3_path), data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    try:
        workers = [c for p in llm.replica_processes for c in descendants(p.pid)]
        assert len(workers) >= 2  # a tensor-parallel worker under each replica
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == token_ids(want_mixed)
        assert all(s.num_finished_requests > 0 for s in llm.replica_stats())
    finally:
        replicas = [p.pid for p in llm.replica_processes]
        shutdown_s = timed_shutdown(llm)
    assert shutdown_s < SHUTDOWN_LIMIT_S
    assert not wait_gone(replicas + workers, SHUTDOWN_LIMIT_S)


def test_async_llm_serves_a_data_parallel_client(qwen3_path, single):
    from nanovllm_core.serving.async_llm import AsyncLLM

    prompts = MIXED[:6]
    want = token_ids(single.generate(prompts, GREEDY, use_tqdm=False))

    async def collect(llm, prompt, request_id):
        return [
            t for out in [o async for o in llm.generate(prompt, GREEDY, request_id)] for t in out.outputs[0].token_ids
        ]

    async def main():
        core = DataParallelClient(EngineConfig(model=str(qwen3_path), data_parallel_size=2, **ENGINE))
        async with AsyncLLM(core) as llm:
            got = await asyncio.gather(*(collect(llm, p, f"r{i}") for i, p in enumerate(prompts)))
            long = await llm.add_request([5, 6, 7] * 10, LONG, "long")
            await long.__anext__()
            await llm.abort("long")
            rest = [out async for out in long]
            stats = await llm.stats()
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await llm.add_request([1, 10**7], GREEDY)
        return core, got, rest, stats

    core, got, rest, stats = asyncio.run(asyncio.wait_for(main(), 120))
    assert got == want
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert stats.num_kv_blocks == 2 * ENGINE["num_kvcache_blocks"]
    assert_idle(stats)
    assert core.loads == [0, 0] and not core.alive


# --- GPUs ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dp-bf16"), "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)


GPU_PROMPTS = [[(7 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 33, 130, 200, 17, 64, 90, 8])]
GPU_ENGINE = dict(max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=64, max_num_seqs=32)


def check_against_one_gpu(path, outs) -> None:
    """Greedy tokens as one engine on one GPU gives them: bf16 near-ties may flip late (another batch), the first
    tokens must agree."""
    import gc

    one = LLM(str(path), **GPU_ENGINE)
    want = token_ids(one.generate(GPU_PROMPTS, GREEDY, use_tqdm=False))
    del one
    gc.collect()
    got = token_ids(outs)
    assert all(g[:4] == w[:4] for g, w in zip(got, want)), (got, want)
    agree = [sum(a == b for a, b in zip(g, w)) / len(w) for g, w in zip(got, want)]
    assert sum(agree) / len(agree) >= 0.9, agree


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_one_replica_each(bf16_path):
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    with LLM(str(bf16_path), data_parallel_size=2, **GPU_ENGINE) as llm:
        free_during = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
        outs = llm.generate(GPU_PROMPTS, GREEDY, use_tqdm=False)
        done = [s.num_finished_requests for s in llm.replica_stats()]
        pids = [p.pid for p in llm.replica_processes]
        start = time.monotonic()
    assert time.monotonic() - start < SHUTDOWN_LIMIT_S
    assert not wait_gone(pids, SHUTDOWN_LIMIT_S)
    # each GPU holds one replica (its CUDA context, weights and KV cache)
    assert all(b - d > 64 * 2**20 for b, d in zip(free_before, free_during)), (free_before, free_during)
    assert min(done) > 0 and sum(done) == len(GPU_PROMPTS)
    check_against_one_gpu(bf16_path, outs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_four_gpus_two_replicas_of_two_tensor_parallel_ranks(bf16_path):
    with LLM(str(bf16_path), data_parallel_size=2, tensor_parallel_size=2, **GPU_ENGINE) as llm:
        outs = llm.generate(GPU_PROMPTS, GREEDY, use_tqdm=False)
        assert all(s.num_finished_requests > 0 for s in llm.replica_stats())
    check_against_one_gpu(bf16_path, outs)


def test_from_config_serves_replicas_and_an_engine_core_refuses_them(qwen3_path):
    from nanovllm_core.engine.config_resolver import create_engine_config
    from nanovllm_core.engine.model_core import ModelEngineCore
    from nanovllm_core.serving.async_llm import AsyncLLM

    with pytest.raises(ConfigError, match="a ModelEngineCore is one replica"):
        ModelEngineCore(create_engine_config(str(qwen3_path), data_parallel_size=2, **ENGINE))

    async def main():
        llm = AsyncLLM.from_config(str(qwen3_path), data_parallel_size=2, **ENGINE)
        async with llm:
            outs = [o async for o in llm.generate([5, 6, 7], GREEDY, "r")]
        return llm, outs

    llm, outs = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(llm.core, DataParallelClient) and llm.core.data_parallel_size == 2
    assert outs[-1].finished and not llm.core.alive
