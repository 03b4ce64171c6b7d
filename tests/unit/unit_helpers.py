"""What the unit tests share."""

from __future__ import annotations

import importlib.util

import pytest

# `nanovllm config` on a checkpoint finishes the config as `generate` does, which names the model plugin of its
# architecture; these tests run wherever the Qwen model plugin is installed (CI), not in the core-only environment
needs_model_plugin = pytest.mark.skipif(
    importlib.util.find_spec("nanovllm_models_qwen3") is None, reason="needs nanovllm-models-qwen3"
)
