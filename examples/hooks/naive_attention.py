"""``naive``: paged attention with plain tensor operations. Slow, but short and correct on any device."""

import torch

from nanovllm_core import AttentionBackend, AttentionBatch, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class NaiveAttentionBackend(AttentionBackend):
    name = "naive"
    priority = -10  # `attention = "auto"` prefers any other available backend

    def forward(self, q, k, v, kv_cache, metadata: AttentionBatch):
        # kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), the default kv_cache_shape.
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        stored = metadata.slot_mapping >= 0  # -1 marks padding, which is not stored
        key_cache[metadata.slot_mapping[stored]] = k[stored]
        value_cache[metadata.slot_mapping[stored]] = v[stored]
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        starts, lengths, bs = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_size
        for i in range(metadata.num_seqs):
            start, end, context = starts[i], starts[i + 1], lengths[i]
            blocks = metadata.block_tables[i, : -(-context // bs)].long()
            slots = (blocks[:, None] * bs + torch.arange(bs, device=q.device)).flatten()[:context]
            keys = key_cache[slots].repeat_interleave(group, dim=1).float()  # [context, heads, head_dim]
            values = value_cache[slots].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * self.scale
            positions = torch.arange(context - (end - start), context, device=q.device)
            scores.masked_fill_(torch.arange(context, device=q.device) > positions[:, None], float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out


@hookimpl
def nanovllm_register_attention_backends(register):
    register("naive", NaiveAttentionBackend)
