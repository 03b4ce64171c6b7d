"""Bad input gets a clear error and loses nothing; one bad request never breaks the others."""

from __future__ import annotations

import json
import shutil

import pytest

from nanovllm_core import LLM, InvalidRequestError, ModelLoadError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=32)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ("", "the prompt is empty"),
        ([1, 2, 100000], r"prompt token ids \[100000\] are outside the vocabulary \[0, 384\)"),
        ([1, -3], r"outside the vocabulary"),
        (list(range(3, 70)), "the prompt has 67 tokens; max_model_len=64 allows at most 63"),
        (3.5, "a prompt is a string or a list of token ids"),
    ],
)
def test_add_request_rejects_and_queues_nothing(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.add_request(prompt, GREEDY)
    assert not llm.has_unfinished_requests()


def test_request_that_can_never_fit_the_kv_cache(qwen3_path):
    small = LLM(str(qwen3_path), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=4)
    with pytest.raises(InvalidRequestError, match="needs up to 5 KV-cache blocks .* the cache holds 4"):
        small.add_request(list(range(3, 60)), SamplingParams(max_tokens=20))
    assert not small.has_unfinished_requests()
    out = small.generate([list(range(3, 40))], GREEDY, use_tqdm=False)[0]  # 37 + 8 tokens fit
    assert out.error is None and len(out.outputs[0].token_ids) == 8


def test_one_bad_prompt_does_not_break_the_batch(llm):
    good = [[5, 6, 7], [8, 9, 10, 11]]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)]
    outs = llm.generate([good[0], [], [1, 10**6], good[1]], GREEDY, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, True]
    assert outs[1].outputs[0].finish_reason == "error" and "empty" in outs[1].error
    assert "outside the vocabulary" in outs[2].error
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == expected
    assert not llm.has_unfinished_requests()


def test_abort_frees_blocks_and_others_finish(llm):
    a = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    b = llm.add_request([8, 9, 10], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.step()
    llm.step()
    aborted = llm.abort_request(a)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert llm.abort_request(a) is None
    finished = []
    while llm.has_unfinished_requests():
        finished += llm.step()
    assert [o.request_id for o in finished] == [b]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_duplicate_request_id(llm):
    llm.add_request([5, 6], GREEDY, request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.add_request([5, 6], GREEDY, request_id="x")
    llm.abort_request("x")


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate([[1, 2], [3, 4]], [GREEDY], use_tqdm=False)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config_json(qwen3_path, tmp_path):
    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json.* is missing"):
        LLM(str(path))


def test_corrupt_config_json(qwen3_path, tmp_path):
    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        LLM(str(path))


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a directory"):
        LLM(str(tmp_path / "nothing"))


def test_corrupt_safetensors(qwen3_path, tmp_path):
    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="is not a readable safetensors file"):
        LLM(str(path), num_kvcache_blocks=8)


def test_missing_safetensors(qwen3_path, tmp_path):
    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors files"):
        LLM(str(path), num_kvcache_blocks=8)


def test_missing_shard_listed_in_index(qwen2_path, tmp_path):
    path = copy_checkpoint(qwen2_path, tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(ModelLoadError, match="shards listed in model.safetensors.index.json are missing"):
        LLM(str(path), num_kvcache_blocks=8)


def test_checkpoint_missing_a_weight(qwen3_path, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing weights for: model.layers.1.mlp.down_proj.weight"):
        LLM(str(path), num_kvcache_blocks=8)


def test_unsupported_architecture_names_it_and_installed(qwen3_path, tmp_path):
    path = copy_checkpoint(qwen3_path, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'LlamaForCausalLM' is not provided .*installed: .*Qwen3ForCausalLM"):
        LLM(str(path))
