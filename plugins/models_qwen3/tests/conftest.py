"""Tiny Qwen3-MoE checkpoints, written once per session with transformers' ``save_pretrained``."""

from __future__ import annotations

from nanovllm_testing import tiny_checkpoint_fixture

MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)

# 3 layers, layer 1 dense (``mlp_only_layers``), 8 experts top-2, renormalised top-k, tied embeddings
moe_path = tiny_checkpoint_fixture("qwen3_moe", num_layers=3, mlp_only_layers=[1], norm_topk_prob=True, **MOE_SHAPE)
# 2 layers with ``decoder_sparse_step=2`` (layer 0 dense, layer 1 sparse), 4 experts top-2, top-k weights not
# renormalised, untied embeddings, weights in several safetensors shards
moe_step2_path = tiny_checkpoint_fixture(
    "qwen3_moe",
    num_layers=2,
    decoder_sparse_step=2,
    norm_topk_prob=False,
    tie_word_embeddings=False,
    max_shard_size="100KB",
    **(MOE_SHAPE | {"num_experts": 4}),
)
