"""One owner of the text: the engine core makes token ids only; ``LLMEngine`` (vLLM's: the front-end over the engine
client) makes the same text as ``LLM.generate``."""

from __future__ import annotations

import pytest

from nanovllm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.output_processor import DecodeStream, IncrementalDetokenizer, OutputProcessor

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = ["Hello, my name is", "The capital of France is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def test_the_engine_core_makes_token_ids_and_no_text(qwen3_path):
    with ModelEngineCore(create_engine_config(str(qwen3_path), **ENGINE)) as core:
        text_makers = (OutputProcessor, IncrementalDetokenizer, DecodeStream)
        assert not [name for name, value in vars(core).items() if isinstance(value, text_makers)]
        for i, prompt in enumerate(PROMPTS):
            core.add_request(prompt, GREEDY, f"r{i}")
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1"]
    for out in outputs:
        (sample,) = out.outputs
        assert len(sample.token_ids) == 12 and sample.text == ""
        assert not any(p.decoded_token for position in sample.logprobs for p in position.values())


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_llm_engine_makes_the_text_llm_generate_makes(qwen3_path, async_scheduling):
    with LLM(str(qwen3_path), async_scheduling=async_scheduling, **ENGINE) as llm:
        expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLMEngine(str(qwen3_path), async_scheduling=async_scheduling, **ENGINE) as engine:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        assert engine.get_num_unfinished_requests() == 2
        steps, outputs = 0, {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            steps += 1
        assert steps >= GREEDY.max_tokens  # one engine step a call
    for i, want in enumerate(expected):
        got = outputs[f"r{i}"]
        assert got.prompt == want.prompt == PROMPTS[i]
        assert got.outputs[0].text == want.outputs[0].text != ""
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got.metrics is not None


def test_llm_engine_aborts_and_reaches_the_engine_core(qwen3_path):
    config = EngineConfig.load(None, {"model": str(qwen3_path), **ENGINE})
    with LLMEngine.from_engine_args(config) as engine:
        assert isinstance(engine.engine_client.engine, ModelEngineCore)
        assert engine.block_manager is engine.engine_client.engine.block_manager
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.step()
        engine.abort_request(["a"])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [o.request_id for o in outputs] == ["b"]
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
