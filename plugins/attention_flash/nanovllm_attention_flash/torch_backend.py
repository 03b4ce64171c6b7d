"""``torch``: paged attention in plain PyTorch. Runs on any device; the reference for the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm_attention_flash.fp8_cache import Fp8CacheSupport, fp8_views, gather_fp8, is_fp8_cache, store_fp8
from nanovllm_core import AttentionBackend, AttentionBatch


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ([tokens, kv_heads, head_dim]) at ``slot_mapping`` of a ``(2, blocks, block, h, d)``
    cache; slots ``-1`` are padding and are skipped."""
    key_cache = kv_cache[0].view(-1, k.size(1), k.size(2))
    value_cache = kv_cache[1].view(-1, v.size(1), v.size(2))
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    key_cache.index_copy_(0, slot_mapping, k)
    value_cache.index_copy_(0, slot_mapping, v)


class TorchAttentionBackend(Fp8CacheSupport, AttentionBackend):
    """One ``scaled_dot_product_attention`` per sequence over keys gathered from its blocks.

    With an FP8 cache (``kv_cache_dtype = "fp8"``, see ``fp8_cache``) every sequence reads its whole context
    back from the cache, dequantised to the model's dtype, the new tokens included, as the Triton kernels do.
    """

    name = "torch"
    priority = 0

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionBatch
    ) -> torch.Tensor:
        fp8 = None
        if is_fp8_cache(kv_cache):
            fp8 = fp8_views(kv_cache, metadata.block_size, self.num_kv_heads, self.head_dim)
            store_fp8(k, v, fp8, metadata.slot_mapping)
        else:
            store_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        bs = metadata.block_size
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_seqs):
            start, end, context = qsl[i], qsl[i + 1], seq_lens[i]
            num_q = end - start
            if num_q == 0:
                continue
            if fp8 is not None:
                blocks = metadata.block_tables[i, : -(-context // bs)].long()
                keys = gather_fp8(fp8, 0, blocks, context, q.dtype)
                values = gather_fp8(fp8, 1, blocks, context, q.dtype)
            elif num_q == context:  # nothing cached before this chunk: the new keys are the whole context
                keys, values = k[start:end], v[start:end]
            else:
                blocks = metadata.block_tables[i, : -(-context // bs)].long()
                keys = kv_cache[0][blocks].flatten(0, 1)[:context]
                values = kv_cache[1][blocks].flatten(0, 1)[:context]
            query = q[start:end].transpose(0, 1)  # [heads, num_q, d]
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            if num_q == 1:
                mask = None
            else:
                q_pos = torch.arange(context - num_q, context, device=q.device).unsqueeze(1)
                mask = torch.arange(context, device=q.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale)
            out[start:end] = o.transpose(0, 1)
        return out
