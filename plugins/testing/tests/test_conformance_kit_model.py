"""The model kit catches models with one bug each (built on the Qwen3 plugin's model, on the tiny checkpoint)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from nanovllm_models_qwen3 import Qwen3ForCausalLM
from nanovllm_testing.conformance import ModelConformance, shared_tiny_checkpoint

from nanovllm_core import ModelLoadError

# --- models with one bug each -----------------------------------------------------------------------


class RollsLogits(Qwen3ForCausalLM):
    def compute_logits(self, hidden_states):
        return super().compute_logits(hidden_states).roll(1, dims=-1)


class LenientLoader(Qwen3ForCausalLM):
    def load_weights(self, weights) -> None:
        try:
            super().load_weights(weights)
        except ModelLoadError:
            pass


@pytest.fixture(scope="module")
def renamed_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3 whose config.json names the architecture ``BrokenQwen3``, so the broken class can take it."""

    def make(architecture: str) -> Path:
        path = tmp_path_factory.mktemp(architecture)
        shutil.copytree(shared_tiny_checkpoint(tmp_path_factory), path, dirs_exist_ok=True)
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [architecture]
        (path / "config.json").write_text(json.dumps(config))
        return path

    return make


def test_model_kit_catches_wrong_logits(renamed_checkpoint) -> None:
    kit = type("Kit", (ModelConformance,), {"model_cls": RollsLogits, "architecture": "RollsLogits"})()
    with pytest.raises(AssertionError, match="first difference"):
        kit.test_greedy_matches_transformers(renamed_checkpoint("RollsLogits"))


def test_model_kit_catches_a_loader_that_accepts_missing_weights(tmp_path_factory) -> None:
    kit = type("Kit", (ModelConformance,), {"model_cls": LenientLoader})()
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        kit.test_load_weights_rejects_an_incomplete_checkpoint(shared_tiny_checkpoint(tmp_path_factory))


def test_model_kit_catches_an_architecture_name_mismatch(tmp_path_factory) -> None:
    kit = type("Kit", (ModelConformance,), {"model_cls": RollsLogits})()
    with pytest.raises(AssertionError, match="architectures"):
        kit.test_checkpoint_names_the_architecture(shared_tiny_checkpoint(tmp_path_factory))
