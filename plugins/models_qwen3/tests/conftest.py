"""Tiny Qwen3-MoE checkpoints, written once per session with transformers' ``save_pretrained``."""

from __future__ import annotations

import pytest

from nanovllm_core.testing import write_tiny_checkpoint

MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)


@pytest.fixture(scope="session")
def moe_path(tmp_path_factory):
    """3 layers, layer 1 dense (``mlp_only_layers``), 8 experts top-2, renormalised top-k, tied embeddings."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe"),
        "qwen3_moe",
        num_layers=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        **MOE_SHAPE,
    )


@pytest.fixture(scope="session")
def moe_step2_path(tmp_path_factory):
    """2 layers with ``decoder_sparse_step=2`` (layer 0 dense, layer 1 sparse), 4 experts top-2, top-k
    weights not renormalised, untied embeddings, weights in several safetensors shards."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe_step2"),
        "qwen3_moe",
        num_layers=2,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        max_shard_size="100KB",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
    )
