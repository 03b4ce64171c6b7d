"""The attention kit catches backends with one bug each (built on the attention plugin's ``torch`` backend)."""

from __future__ import annotations

import pytest
import torch
from kit_helpers import KitFailure
from nanovllm_attention_flash import TorchAttentionBackend
from nanovllm_testing.conformance import AttentionBackendConformance

# --- attention backends with one bug each -----------------------------------------------------------


class ScaleOffByOnePercent(TorchAttentionBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale *= 1.01


class ForgetsToStore(TorchAttentionBackend):
    def forward(self, q, k, v, kv_cache, metadata):
        return super().forward(q, k, v, kv_cache.clone(), metadata)


class IgnoresGqaGrouping(TorchAttentionBackend):
    """Maps query head h to kv head h % num_kv_heads instead of h // group: right only for MHA."""

    def forward(self, q, k, v, kv_cache, metadata):
        group = self.num_heads // self.num_kv_heads
        order = torch.arange(self.num_heads).view(self.num_kv_heads, group).t().reshape(-1)
        return super().forward(q[:, order], k, v, kv_cache, metadata)[:, order.argsort()]


@pytest.mark.parametrize(
    "broken, heads",
    [(ScaleOffByOnePercent, (4, 4)), (ForgetsToStore, (4, 4)), (IgnoresGqaGrouping, (8, 2))],
)
def test_attention_kit_catches(broken: type, heads: tuple[int, int]) -> None:
    kit = type("Kit", (AttentionBackendConformance,), {"backend_cls": broken, "head_dim": 32})()
    with pytest.raises(KitFailure, match="sequence"):
        kit.test_ragged_batches_match_dense_attention(*heads)


def test_attention_kit_passes_mha_for_the_gqa_bug() -> None:
    """The GQA bug is invisible with one query head per kv head, which is why the kit checks both."""
    kit = type("Kit", (AttentionBackendConformance,), {"backend_cls": IgnoresGqaGrouping, "head_dim": 32})()
    kit.test_ragged_batches_match_dense_attention(4, 4)
