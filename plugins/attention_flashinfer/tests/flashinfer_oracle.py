"""Test oracle: paged attention that reads exactly what FlashInfer reads, in float64 PyTorch (not a backend).

:func:`paged_attention` takes FlashInfer's page table (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
``kv_last_page_len``) and ``NHD`` page tensors, with the per-(token, head) scales of FlashInfer's
``use_token_head_sf`` path for an FP8 cache, and computes what FlashInfer's batch prefill/decode kernels define:
row ``i`` attends its ``qo_indptr[i + 1] - qo_indptr[i]`` queries to the first
``(pages - 1) * page_size + kv_last_page_len[i]`` tokens of its pages (0 without a page), causal with the queries
at the end of that context. It learns the lengths from the page table alone, so the tests that compare it with the
``torch`` backend (which reads the engine's ``seq_lens`` and block tables) check the layout code.
"""

from __future__ import annotations

import torch


def paged_attention(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sm_scale: float,
    kv_cache_sf: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q`` ``[qo_indptr[-1] (or more), num_qo_heads, head_dim]``; ``k_cache``/``v_cache`` ``[num_pages,
    page_size, num_kv_heads, head_dim]``; ``kv_cache_sf``: float32 ``[num_pages, page_size, num_kv_heads]`` each
    (value = stored * scale). Returns float64 ``q.shape``; rows of no context and tokens of no row are 0."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    qo, kvp, idx, last = (t.cpu().long() for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len))
    assert len(qo) == len(kvp) == len(last) + 1, "indptr arrays must have one more entry than last_page_len"
    assert bool((qo[1:] >= qo[:-1]).all()) and bool((kvp[1:] >= kvp[:-1]).all()), "indptr must not decrease"
    assert int(kvp[-1]) <= len(idx), f"kv_indptr[-1] = {int(kvp[-1])} but only {len(idx)} page indices"
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row in range(len(last)):
        q0, q1, p0, p1 = int(qo[row]), int(qo[row + 1]), int(kvp[row]), int(kvp[row + 1])
        if p1 > p0:  # FlashInfer's contract for a row with pages
            assert 1 <= int(last[row]) <= page_size, f"row {row}: last_page_len {int(last[row])} out of range"
        kv_len = 0 if p1 == p0 else (p1 - p0 - 1) * page_size + int(last[row])
        if q1 == q0 or kv_len == 0:
            continue
        assert q1 - q0 <= kv_len, f"row {row}: {q1 - q0} queries but a context of {kv_len} tokens"
        pages = idx[p0:p1].to(k_cache.device)
        keys = k_cache[pages].flatten(0, 1)[:kv_len].float().double().cpu()
        values = v_cache[pages].flatten(0, 1)[:kv_len].float().double().cpu()
        if kv_cache_sf is not None:
            keys = keys * kv_cache_sf[0][pages].flatten(0, 1)[:kv_len].double().cpu().unsqueeze(-1)
            values = values * kv_cache_sf[1][pages].flatten(0, 1)[:kv_len].double().cpu().unsqueeze(-1)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        query = q[q0:q1].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", query, keys) * sm_scale
        position = torch.arange(kv_len - (q1 - q0), kv_len).unsqueeze(1)  # each query's place in its context
        scores = scores.masked_fill(torch.arange(kv_len).unsqueeze(0) > position, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out
