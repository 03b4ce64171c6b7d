from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_core.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (padded to a multiple of the rank count)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: shard.size(0)].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary; logits are gathered so every rank sees the full vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden_states, self.weight)
        logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
