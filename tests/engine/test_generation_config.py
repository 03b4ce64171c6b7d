"""vLLM's ``--generation-config``: the checkpoint's generation_config.json sets the sampling defaults of requests
that leave them out, offline (``LLM.generate`` without sampling params) and in the server (field by field)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.config import EngineConfig
from nanovllm_core.errors import ConfigError
from nanovllm_core.generation_config import sampling_defaults
from nanovllm_core.serving.protocol import ChatCompletionRequest, CompletionRequest

ENGINE = dict(device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def recommended(qwen3_path, tmp_path_factory):
    """The tiny checkpoint with a generation_config.json that recommends greedy decoding and a top-k."""
    folder = tmp_path_factory.mktemp("recommended") / "model"
    shutil.copytree(qwen3_path, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(temperature=0.0, top_k=7, top_p=0.9, do_sample=True, max_new_tokens=99)
    path.write_text(json.dumps(config))
    return folder


def test_generate_without_params_samples_as_the_checkpoint_recommends(recommended) -> None:
    llm = LLM(str(recommended), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.0, 7, 0.9, 16)
    prompt = [10, 11, 12]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert llm.generate([prompt], use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    plain = LLM(str(recommended), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, -1, 1.0)


def test_a_folder_without_the_file_is_a_config_error_and_bad_values_are_left_out(recommended, tmp_path, caplog):
    with pytest.raises(ConfigError, match="generation_config=.*generation_config.json does not exist"):
        sampling_defaults(EngineConfig(model=str(recommended), generation_config=str(tmp_path)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5, "temperature": 0.7}))
    with caplog.at_level(logging.WARNING):
        assert sampling_defaults(EngineConfig(model=str(recommended), generation_config=str(tmp_path))) == {
            "temperature": 0.7}  # fmt: skip
    assert "top_p=5 is invalid" in caplog.text


def test_the_servers_requests_take_the_defaults_for_the_fields_they_leave_out() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    left_out = CompletionRequest(prompt="x").sampling_params(16, None, defaults=defaults)
    assert (left_out.temperature, left_out.top_k, left_out.top_p, left_out.repetition_penalty) == (0.6, 20, 0.95, 1.1)
    explicit = CompletionRequest(prompt="x", temperature=1.0, top_k=-1).sampling_params(16, None, defaults=defaults)
    assert (explicit.temperature, explicit.top_k, explicit.top_p) == (1.0, -1, 0.95)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=1.0)
    params = chat.sampling_params(16, None, defaults=defaults)
    assert (params.temperature, params.top_p) == (0.6, 1.0)
    assert CompletionRequest(prompt="x").sampling_params(16, None).temperature == 1.0  # no defaults: OpenAI's
