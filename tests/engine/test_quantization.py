"""Choosing a quantization method: from the config or the checkpoint, checked before any weight loads, with one
line for each way it can be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from nanovllm_testing import write_tiny_checkpoint
from nanovllm_testing.conformance import registered_for_test

from nanovllm_core import LLM, ConfigError, ModelLoadError, QuantizationMethod, UnknownPluginError
from nanovllm_core.engine.model_core import select_quantization
from nanovllm_core.plugins import get_registry, missing_hint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plain"), "qwen3")


def stored_as(tmp_path, quantization_config):
    path = write_tiny_checkpoint(tmp_path / "stored", "qwen3")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def select(name, path):
    from nanovllm_core.loader import load_hf_config

    return select_quantization(get_registry(), name, load_hf_config(path), str(path), CPU)


def test_a_plain_checkpoint_without_a_setting_is_not_quantized(plain):
    assert select(None, plain) is None


def test_a_method_no_plugin_provides_names_the_method(tmp_path):
    path = stored_as(tmp_path, {"quant_method": "awq", "bits": 4})
    with pytest.raises(UnknownPluginError, match=r"stored quantized with 'awq': no quantization named 'awq'"):
        LLM(str(path))
    assert "pip install nanovllm-quant-fp8" in missing_hint("quantization", "fp8")


def test_a_setting_that_contradicts_the_checkpoint_names_both(tmp_path):
    path = stored_as(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match=r"quantization='int4' contradicts .* quant_method 'fp8'"):
        select("int4", path)


def test_a_quantization_config_without_a_method_is_a_load_error(tmp_path):
    path = stored_as(tmp_path, {"bits": 8})
    with pytest.raises(ModelLoadError, match="quantization_config without a quant_method"):
        select(None, path)


class ReadsOnlyItsOwnCheckpoints(QuantizationMethod):
    def linear_method(self, prefix, layer):
        return None


class NeedsAnotherDevice(QuantizationMethod):
    quantizes_on_load = True

    @classmethod
    def check_available(cls, device):
        return "it needs a device this machine lacks"

    def linear_method(self, prefix, layer):
        return None


class LeavesAlone(QuantizationMethod):
    quantizes_on_load = True

    def linear_method(self, prefix, layer):
        return None


def test_a_method_that_cannot_quantize_at_load_refuses_a_plain_checkpoint(plain):
    with registered_for_test("quantization", ReadsOnlyItsOwnCheckpoints, "stored-only"):
        with pytest.raises(ConfigError, match="'stored-only' reads checkpoints stored quantized"):
            select("stored-only", plain)


def test_a_method_unavailable_on_the_device_says_why(plain):
    with registered_for_test("quantization", NeedsAnotherDevice, "elsewhere"):
        with pytest.raises(ConfigError, match="'elsewhere' cannot run on cpu: it needs a device this machine lacks"):
            select("elsewhere", plain)


def test_a_method_that_leaves_every_layer_alone_changes_nothing(plain):
    from nanovllm_core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(plain)).generate([[5, 6, 7]], params, use_tqdm=False)]
    with registered_for_test("quantization", LeavesAlone, "none-at-all"):
        llm = LLM(str(plain), quantization="none-at-all")
        got = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]], params, use_tqdm=False)]
    assert got == want and llm.config.quantization == "none-at-all"
