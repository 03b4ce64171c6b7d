"""The engine owns requests (plugin API 2): ids, samples, streamed outputs, metrics, stats, aborts, threads."""

from __future__ import annotations

import logging
import re
import threading

import numpy as np
import pytest
import torch

from nanovllm_core import LLM, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [12] * 40]


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_delta_outputs_add_up_to_the_final_output(llm, expected):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind="delta")
    ids = [llm.add_request(p, params) for p in PROMPTS]
    tokens = {i: [] for i in ids}
    text = dict.fromkeys(ids, "")
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            text[out.request_id] += out.outputs[0].text
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert [tokens[i] for i in ids] == expected
    assert finished == dict.fromkeys(ids, "length")
    final = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [text[i] for i in ids] == [o.outputs[0].text for o in final]


def test_detokenize_off_returns_token_ids_only(llm, expected):
    for kind in ("delta", "final"):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind, detokenize=False)
        ids = [llm.add_request(p, params) for p in PROMPTS]
        tokens = {i: [] for i in ids}
        while llm.has_unfinished_requests():
            for out in llm.step():
                assert out.outputs[0].text == ""
                tokens[out.request_id] += out.outputs[0].token_ids
        assert [tokens[i] for i in ids] == expected


def test_detokenize_off_is_validated():
    with pytest.raises(InvalidRequestError, match=r"detokenize=False is invalid: allowed True when stop strings"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(InvalidRequestError, match=r"detokenize=1 is invalid: allowed True or False"):
        SamplingParams(detokenize=1)


def test_n_samples_share_the_prompt_through_the_prefix_cache(llm):
    prompt = list(range(3, 3 + 40))
    before = llm.stats()
    out = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=7), use_tqdm=False)[0]
    after = llm.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeded samples came out identical"
    # samples 2 and 3 start after the first computed the prompt: they find its 2 full blocks cached
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * 32
    again = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=7), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_metrics_and_stats(llm):
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert (m.num_prompt_tokens, m.num_generation_tokens) == (20, 8)
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.kv_cache_usage == 0.0
    assert stats.num_generation_tokens >= 8 and stats.num_finished_requests >= 1


def test_abort_mid_decode_returns_the_partial_output_and_frees_blocks(llm):
    rid = llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert llm.stats().num_free_kv_blocks < llm.stats().num_kv_blocks
    out = llm.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 50
    assert llm.abort_request(rid) is None
    assert llm.stats().num_free_kv_blocks == llm.stats().num_kv_blocks
    assert not llm.has_unfinished_requests() or llm.step() == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, 2.5, 4], r"holds 2.5 \(float\)"),
        ([True, 3], r"holds True \(bool\)"),
        ("bad \ud800", "cannot be tokenized"),
    ],
)
def test_bad_prompts_get_their_own_error_output(llm, expected, prompt, message):
    outs = llm.generate([PROMPTS[0], prompt, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert re.search(message, outs[1].error), outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected[:2]
    assert not llm.has_unfinished_requests()


def test_a_single_bad_token_prompt_names_the_bad_token(llm):
    out = llm.generate([1, 2.5, 4], GREEDY, use_tqdm=False)
    assert len(out) == 1 and "holds 2.5 (float)" in out[0].error


def test_numpy_and_torch_integer_token_ids_are_accepted(llm, expected):
    prompts = [list(np.array(PROMPTS[0], dtype=np.int64)), list(torch.tensor(PROMPTS[1]))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]


def test_an_interrupt_while_prompts_are_added_leaves_nothing_queued(llm, expected, monkeypatch):
    added = []
    core = llm.engine_client.engine  # the engine core of this process
    real_add = core.add_request

    def add_then_interrupt(*args, **kwargs):
        if len(added) == 2:
            raise KeyboardInterrupt
        added.append(real_add(*args, **kwargs))
        return added[-1]

    monkeypatch.setattr(core, "add_request", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.has_unfinished_requests() and llm.stats().num_free_kv_blocks == llm.stats().num_kv_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_generate_refuses_to_swallow_requests_added_by_hand(llm, expected):
    rid = llm.add_request(PROMPTS[2], GREEDY)
    with pytest.raises(InvalidRequestError, match="added with add_request"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [o.request_id for o in outputs] == [rid] and outputs[0].outputs[0].token_ids == expected[2]


def test_two_threads_calling_generate_both_get_correct_outputs(llm, expected):
    results: dict[int, list[list[int]]] = {}
    errors = []

    def worker(k: int) -> None:
        try:
            prompts = PROMPTS[k:] + PROMPTS[:k]
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            results[k] = [o.outputs[0].token_ids for o in outs]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for k in range(3):
        assert results[k] == expected[k:] + expected[:k]


def test_request_ids_are_unique_and_checked(llm):
    rid = llm.add_request(PROMPTS[0], GREEDY, request_id="mine")
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.add_request(PROMPTS[1], GREEDY, request_id="mine")
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        llm.add_request(PROMPTS[1], GREEDY, request_id="")
    llm.abort_request(rid)
    assert not llm.has_unfinished_requests() or not llm.step()


def test_startup_warmup_leaves_no_trace(qwen3_path, expected):
    warm = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40, warmup="on")
    stats = warm.stats()
    assert not warm.has_unfinished_requests() and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert (stats.num_generation_tokens, stats.num_prompt_tokens, stats.num_finished_requests) == (0, 0, 0)
    assert [o.outputs[0].token_ids for o in warm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_warmup_first_step_fills_the_token_budget(qwen3_path, monkeypatch, caplog):
    """The warm-up's first step holds max_num_batched_tokens prompt tokens, as a large batch's first generate
    does: the activations' largest size is allocated at start-up, not in that generate (issue 14's cold first run).
    Its steps then decode a full batch, and the warm-up leaves no trace."""
    from nanovllm_core.engine.core import EngineCore

    steps: list[tuple[int, int]] = []
    check = EngineCore._check_step

    def recorded(self, batch):
        steps.append((len(batch), batch.total_new_tokens))
        return check(self, batch)

    monkeypatch.setattr(EngineCore, "_check_step", recorded)
    with caplog.at_level(logging.INFO, logger="nanovllm_core.engine.model_core"):
        warm = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=80,
                   max_num_batched_tokens=200, max_num_seqs=24, warmup="on")  # fmt: skip
    assert re.search(r"a [\d.]+ s warm-up .* ran a step of max_num_batched_tokens", caplog.text)
    assert steps[0][1] == 200  # before, the prompts of the warm-up's first step added up to 193 tokens
    assert max(n for n, _ in steps) == 24  # a step of max_num_seqs sequences
    stats = warm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_prompt_tokens == 0


def test_start_up_ends_with_a_full_garbage_collection(qwen3_path, caplog):
    """So that the first generate does not pay for the collection start-up made due (the log says how long)."""
    import gc
    import logging

    from nanovllm_core.engine.config_resolver import create_engine_config
    from nanovllm_core.engine.model_core import ModelEngineCore
    from nanovllm_core.gc_heap import GCPauses

    with caplog.at_level(logging.INFO, logger="nanovllm_core.engine.model_core"), GCPauses() as pauses:
        config = create_engine_config(str(qwen3_path), kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40)
        engine = ModelEngineCore(config)
    assert pauses.collections[2] >= 1
    assert re.search(r"start-up took [\d.]+ s: .* a [\d.]+ s garbage collection", caplog.text)
    assert "no warm-up (warmup='auto')" in caplog.text  # auto: on CUDA only
    engine.shutdown()
    gc.collect()


def test_priority_argument_sets_each_requests_priority(llm, expected):
    """vLLM's ``priority=`` of ``add_request`` and ``generate``: it sets the request's SamplingParams.priority
    (the caller's object is left as it was), one integer per prompt, validated before anything is queued."""
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, priority=5)
    rid = llm.add_request(PROMPTS[0], base, priority=-2)
    other = llm.add_request(PROMPTS[1], base)
    seen = {seq.request_id: seq.sampling_params.priority for seq in llm.scheduler.waiting}
    assert (seen[rid], seen[other], base.priority) == (-2, 5, 5)
    while llm.has_unfinished_requests():
        llm.step()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outs] == expected
    for bad, message in (([0, 1], "one integer per prompt (3 prompts)"), ("012", "one integer per prompt"),
                         ([0, "1", 2], "priority='1' is invalid: allowed an integer")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=bad)
        assert not llm.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="priority=True is invalid"):
        llm.add_request(PROMPTS[0], GREEDY, priority=True)
    assert not llm.has_unfinished_requests()


def test_vllm_prompt_dicts_are_prompts(llm, expected):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, give what their text or ids give."""
    text = llm.get_tokenizer().decode(PROMPTS[0])
    assert llm.get_tokenizer() is llm.tokenizer
    by_text = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == by_text and outs[0].prompt == text
    assert outs[1].outputs[0].token_ids == expected[1]
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[0]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, r"'prompt' \(text\) or 'prompt_token_ids'.*not 'multi_modal_data'"),
        ({}, "it holds neither"),
        ({"prompt_token_ids": [1, "x"]}, r"holds 'x' \(str\)"),
    ],
)
def test_bad_prompt_dicts_are_rejected_naming_what_is_allowed(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.add_request(prompt, GREEDY)
    assert not llm.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    long = list(range(3, 203))  # 200 tokens: over max_model_len=128
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=50)
    out = llm.generate([long], params, use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == long[-50:]
    assert out.outputs[0].token_ids == llm.generate([long[-50:]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:4]
    short = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert short.prompt_token_ids == [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens=0 is invalid"):
        SamplingParams(truncate_prompt_tokens=0)


def test_generate_of_something_that_is_no_prompt_names_what_is_allowed(llm):
    with pytest.raises(InvalidRequestError, match="prompts must be a string, a list of token ids .* not int"):
        llm.generate(5, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
