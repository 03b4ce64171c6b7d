"""The tiny Qwen3 checkpoint of the simulator's parity test, written once per session (no download)."""

from __future__ import annotations

import pytest
from nanovllm_testing import write_tiny_checkpoint


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory):
    """Tiny Qwen3: tied embeddings, GQA 4:2, head_dim 32 != hidden/heads (16)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
