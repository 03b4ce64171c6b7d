"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the tokens of one-step-at-a-time.

On CPU nothing overlaps, but the bookkeeping is the same as on CUDA: placeholder tokens, inputs taken from
the previous step's sampled tensor, stops found one step late, sequences leaving through ``abort``.
"""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, MAX_NEW, PROMPTS, make_prompts

from nanovllm_core import LLM, PLACEHOLDER_TOKEN, SamplingParams
from nanovllm_core.errors import ConfigError


def engine(path, mode: str = "on", **kwargs) -> LLM:
    kwargs.setdefault("num_kvcache_blocks", 128)
    return LLM(str(path), kvcache_block_size=16, max_model_len=512, async_scheduling=mode, **kwargs)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_num_batched_tokens": 48, "max_num_seqs": 8},  # chunked prefill
        {"num_kvcache_blocks": 16},  # preemption
        {"num_kvcache_blocks": 12, "max_num_batched_tokens": 40, "max_num_seqs": 8, "kvcache_block_size": 32},
    ],
    ids=["plain", "chunked", "preempted", "preempted-chunked-bs32"],
)
def test_greedy_matches_transformers(qwen3_path, hf_reference, kwargs):
    block_size = kwargs.pop("kvcache_block_size", 16)
    llm = LLM(str(qwen3_path), max_model_len=512, async_scheduling="on", kvcache_block_size=block_size, **kwargs)
    assert llm.async_scheduling
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_reference(qwen3_path, PROMPTS, MAX_NEW)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    if kwargs.get("num_kvcache_blocks", 128) < 20:
        assert llm.scheduler.num_preemptions > 0


def test_prefix_cache_hits_and_qwen2(qwen2_path, hf_reference):
    shared = make_prompts(1, [50])[0]
    prompts = [shared + tail for tail in make_prompts(2, [3, 9, 20])]
    llm = engine(qwen2_path)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(first + rest) == hf_reference(qwen2_path, prompts, MAX_NEW)
    assert [o.num_cached_tokens for o in rest] == [48, 48]
    again = llm.generate(prompts[2:], GREEDY, use_tqdm=False)  # blocks hashed from async steps are reused
    assert again[0].num_cached_tokens == 64
    assert tokens(again) == tokens(rest[1:])


def test_sampled_tokens_equal_sync(qwen3_path):
    # same batches in both modes (only length stops), so even the engine-seeded draws are the same
    params = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 30, 1)]
    sync = engine(qwen3_path, "off", seed=7).generate(PROMPTS, params, use_tqdm=False)
    overlapped = engine(qwen3_path, "on", seed=7).generate(PROMPTS, params, use_tqdm=False)
    assert tokens(overlapped) == tokens(sync)
    assert [len(t) for t in tokens(overlapped)] == [3, 9, 17, 30, 1]


def test_stops_found_a_step_late_end_at_the_right_token(qwen3_path):
    sync = engine(qwen3_path, "off")
    llm = engine(qwen3_path)
    full = tokens(sync.generate(PROMPTS, GREEDY, use_tqdm=False))
    stop_ids = [seq[4] for seq in full[:3]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[t]) for t in stop_ids]
    params += [GREEDY, SamplingParams(temperature=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=3)]
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outs) == tokens(expected)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 3 + ["length"] * 2
    for out, stop in zip(outs, stop_ids):
        assert out.outputs[0].token_ids[-1] == stop and out.outputs[0].stop_reason == stop
    assert all(PLACEHOLDER_TOKEN not in t for t in tokens(outs))
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    # a stop string, checked on the real token once it arrives
    text = sync.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[6:9]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=stop)
    want, got = (e.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0] for e in (sync, llm))
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")


def test_max_model_len_is_never_exceeded(qwen3_path):
    llm = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=48, num_kvcache_blocks=3, async_scheduling="on")
    out = llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 48 - 37


def test_abort_while_a_step_is_in_flight(qwen3_path):
    llm = engine(qwen3_path)
    keep = llm.add_request(PROMPTS[0], GREEDY)
    drop = llm.add_request(PROMPTS[1], GREEDY)
    short = llm.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        llm.step()
    aborted = llm.abort_request(drop)
    assert aborted.outputs[0].finish_reason == "abort"
    assert PLACEHOLDER_TOKEN not in aborted.outputs[0].token_ids
    # `short` reached its length limit in the step just launched: it waits for its last token, abortable too
    assert llm.abort_request(short).outputs[0].finish_reason == "abort"
    finished = []
    while llm.has_unfinished_requests():
        finished += llm.step()
    assert [o.request_id for o in finished] == [keep]
    assert finished[0].outputs[0].token_ids == tokens(engine(qwen3_path, "off").generate([PROMPTS[0]], GREEDY))[0]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_auto_is_off_on_cpu_and_on_rejects_nothing_here(qwen3_path):
    assert not engine(qwen3_path, "auto").async_scheduling
    assert engine(qwen3_path, "on").async_scheduling
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(str(qwen3_path), async_scheduling="sometimes")
