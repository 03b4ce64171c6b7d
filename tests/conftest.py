from __future__ import annotations

import signal

import pytest
import torch
from nanovllm_testing import hf_greedy, tiny_checkpoint_fixture


def pytest_configure(config):
    # A run started in the background of a non-interactive shell (`make test &`) inherits SIGINT ignored, as would
    # every process it starts; the Ctrl-C tests need Python's default handler.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny Qwen3: tied embeddings, GQA 4:2, head_dim 32 != hidden/heads (16)
qwen3_path = tiny_checkpoint_fixture("qwen3")
# Tiny Qwen2: q/k/v bias, untied embeddings, GQA 4:1, weights in several safetensors shards
qwen2_path = tiny_checkpoint_fixture(
    "qwen2", num_heads=4, num_kv_heads=1, head_dim=16, tie_word_embeddings=False, max_shard_size="100KB"
)


@pytest.fixture(scope="session")
def hf_reference():
    """Memoised transformers greedy outputs: hf_reference(path, prompts, n)."""
    cache: dict = {}

    def get(path, prompts, max_new_tokens):
        key = (str(path), tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(path, prompts, max_new_tokens)
        return cache[key]

    return get


@pytest.fixture
def fusion_on_without_compiling(monkeypatch):
    """``set_compile(True)`` for one test, with ``torch.compile`` a pass-through: what these tests check is which
    path a CPU tensor takes with fusion on, and inductor's CPU build (seconds of C++ a function) is torch's. The
    pass-throughs go with the test (a cache of their own): a later test in the process compiles for real."""
    from nanovllm_core.layers import fused

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(fused, "_compiled", {})
    fused.set_compile(True)
    yield
    fused.set_compile(False)
