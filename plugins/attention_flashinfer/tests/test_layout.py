"""The layout code (``nanovllm_attention_flashinfer.layout``) on the CPU, without flashinfer.

FlashInfer's page table built from the engine's step metadata is checked by hand, against a plain loop, and end
to end: :func:`flashinfer_oracle.paged_attention`, which reads only that table and the ``NHD`` page tensors (the
FP8 scales too), reproduces the ``torch`` backend and the conformance kit's dense reference on ragged batches:
decode with CUDA-graph padding rows, prompts, prefix-cache hits, chunks over a cached prefix and mixed steps;
MHA and GQA; block sizes 16, 32 and 64; the fixed-capacity buffers of captured decode steps refreshed over
successive steps; the FP8 cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from flashinfer_oracle import paged_attention
from nanovllm_attention_flash import TorchAttentionBackend
from nanovllm_attention_flash.testing import STEP_KINDS as KINDS
from nanovllm_attention_flash.testing import PagedCase, make_case, reference, step_lengths
from nanovllm_attention_flashinfer.layout import (
    GraphLayout,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    paged_kv_views,
    step_layout,
)
from nanovllm_testing.conformance import dense_attention

from nanovllm_core import AttentionBatch
from nanovllm_core.engine.cuda_graph import MixedStepBuffers

ATOL, RTOL = 2e-5, 1e-5  # float32 torch backend against the float64 oracle


def test_layout_by_hand() -> None:
    seq_lens = torch.tensor([5, 0, 4, 9, 1], dtype=torch.int32)
    tables = torch.tensor([[7, 2, 0], [0, 0, 0], [3, 0, 0], [1, 5, 6], [4, 0, 0]], dtype=torch.int32)
    indptr = kv_indptr(seq_lens, 4)
    assert indptr.tolist() == [0, 2, 2, 3, 6, 7]
    assert kv_last_page_len(seq_lens, 4).tolist() == [1, 0, 4, 1, 1]
    assert kv_indices(tables, indptr, capacity=7).tolist() == [7, 2, 3, 1, 5, 6, 4]
    out = torch.full((15,), -1, dtype=torch.int32)  # a fixed-capacity buffer: the tail is never read
    kv_indices(tables, indptr, out=out)
    assert out[:7].tolist() == [7, 2, 3, 1, 5, 6, 4] and bool((out >= 0).all())


@pytest.mark.parametrize("seed", range(20))
def test_layout_matches_a_loop(seed: int) -> None:
    rnd = random.Random(seed)
    bs = rnd.choice([16, 32, 64])
    rows = rnd.randint(1, 12)
    lens = [rnd.choice([0, rnd.randint(1, 300)]) for _ in range(rows)]
    width = max(-(-n // bs) for n in lens) + rnd.randint(0, 3) or 1
    tables = [[rnd.randrange(1000) for _ in range(width)] for _ in range(rows)]
    pages = [-(-n // bs) for n in lens]
    expected = [b for table, p in zip(tables, pages) for b in table[:p]]
    seq_lens, block_tables = torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)
    indptr = kv_indptr(seq_lens, bs)
    assert indptr.tolist() == [sum(pages[:i]) for i in range(rows + 1)]
    assert kv_last_page_len(seq_lens, bs).tolist() == [n - (p - 1) * bs if p else 0 for n, p in zip(lens, pages)]
    assert kv_indices(block_tables, indptr, capacity=len(expected)).tolist() == expected
    graph = GraphLayout(rows + 2, width + 1, torch.device("cpu"))
    graph.refresh(seq_lens, block_tables, bs)
    g_indptr, g_indices, g_last = graph.buffers(rows, width)
    assert g_indptr.tolist() == indptr.tolist()
    assert g_last.tolist() == kv_last_page_len(seq_lens, bs).tolist()
    assert g_indices[: len(expected)].tolist() == expected


HEADS = pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])


def oracle(case: PagedCase) -> torch.Tensor:
    """The oracle on a step whose new keys/values are in the cache already (``PagedCase.prestored``)."""
    layout = step_layout(case.batch)
    k_cache, v_cache, sf = paged_kv_views(case.kv_cache, case.batch.block_size, case.num_kv_heads, case.head_dim)
    return paged_attention(
        case.q, layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len,
        k_cache, v_cache, case.scale, sf,
    )  # fmt: skip


@HEADS
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_oracle_on_the_layout_matches_the_torch_backend(kind: str, block_size: int, num_heads: int, num_kv_heads: int):
    query_lens, context_lens, pad = step_lengths(kind, block_size, seed=block_size + num_kv_heads, small=True)
    case = make_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                     block_size=block_size, num_pad_rows=pad, table_width=12 if pad else None)  # fmt: skip
    expected = reference(case, TorchAttentionBackend)  # stores the step's keys/values itself
    torch.testing.assert_close(oracle(case.prestored()).float(), expected, atol=ATOL, rtol=RTOL)


@HEADS
@pytest.mark.parametrize("kind", ["decode", "mixed", "chunked"])
def test_oracle_on_the_layout_matches_dense_attention(kind: str, num_heads: int, num_kv_heads: int) -> None:
    """Independent of the ``torch`` backend: each sequence's whole context gathered by its engine slots, then the
    kit's dense float64 attention."""
    bs = 16
    query_lens, context_lens, _ = step_lengths(kind, bs, seed=7, small=True)
    case = make_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                     block_size=bs).prestored()  # fmt: skip
    got = oracle(case)
    tables, qsl = case.batch.block_tables.tolist(), case.batch.query_start_loc_cpu
    flat = case.kv_cache.view(2, -1, num_kv_heads, 32)
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(ctx + n)])
        q = case.q[qsl[i] : qsl[i + 1]]
        torch.testing.assert_close(got[qsl[i] : qsl[i + 1]], dense_attention(q, flat[0, slots], flat[1, slots], ctx,
                                   case.scale), atol=1e-9, rtol=1e-9)  # fmt: skip


@HEADS
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_oracle_reads_the_fp8_scales_as_the_torch_backend(kind: str, num_heads: int, num_kv_heads: int) -> None:
    """FP8 cache: ``paged_kv_views``' transposed scale views, read as FlashInfer's per-(token, head) scales, give
    the ``torch`` backend's output on the same e4m3 values and scales."""
    query_lens, context_lens, pad = step_lengths(kind, 32, seed=3, small=True)
    case = make_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                     block_size=32, num_pad_rows=pad, unused_fill=0.0).fp8().prestored()  # fmt: skip
    torch_backend = case.backend(TorchAttentionBackend)
    real = sum(1 for s in case.batch.seq_lens_cpu if s)
    n = case.batch.query_start_loc_cpu[real]
    sub = case.batch.head(real)
    expected = torch_backend.forward(case.q[:n], case.k[:n], case.v[:n], case.kv_cache.clone(), sub)
    got = oracle(case)
    torch.testing.assert_close(got[:n].float(), expected, atol=ATOL, rtol=RTOL)
    assert not got[n:].any(), "padding rows attend to nothing"


@HEADS
@pytest.mark.parametrize("block_size", [16, 64])
def test_graph_buffers_over_successive_decode_steps(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    """The captured decode path: the runner's static batch (``MixedStepBuffers``, decode) refilled step after step
    with fewer rows than its bucket and shorter or longer contexts than before (stale entries stay in its block
    tables), ``GraphLayout.refresh`` over it, and the oracle reading the fixed buffers as the captured wrapper does
    (one query a row, padding rows included) against the ``torch`` backend on each step's own batch."""
    device = torch.device("cpu")
    max_model_len = 200
    buffers = MixedStepBuffers(12, 12, max_model_len, block_size, device, decode=True)
    graph = GraphLayout(buffers.max_seqs, buffers.max_blocks, device)
    rnd = random.Random(block_size)
    for step, rows in enumerate([7, 3, 12, 5, 1]):
        contexts = [rnd.randint(0, max_model_len - 1) for _ in range(rows)]
        case = make_case([1] * rows, contexts, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                         block_size=block_size, seed=step)  # fmt: skip
        ids = torch.zeros(rows, dtype=torch.int64)
        size = buffers.load(ids, ids, case.batch)
        bucket = buffers.bucket(size)
        graph.refresh(bucket.seq_lens, bucket.block_tables, block_size)
        indptr, indices, last = graph.buffers(size, buffers.max_blocks)
        stored = case.prestored()
        k_cache, v_cache, _ = paged_kv_views(stored.kv_cache, block_size, num_kv_heads, 32)
        q = torch.cat([case.q, torch.full((size - rows, num_heads, 32), float("nan"))])
        got = paged_attention(q, torch.arange(size + 1, dtype=torch.int32), indptr, indices, last, k_cache, v_cache,
                              case.scale)  # fmt: skip
        torch.testing.assert_close(got[:rows].float(), reference(case, TorchAttentionBackend), atol=ATOL, rtol=RTOL)
        assert int(indptr[-1]) == sum(-(-(c + 1) // block_size) for c in contexts)


def test_step_layout_of_the_conformance_steps() -> None:
    """``step_layout`` of a step built like the kit's (``AttentionBatch.from_spans``): a chunk over a cached prefix,
    a prompt and a decode token, with its host arrays on the CPU and its page indices on the batch's device."""
    tables = [[9, 4, 6], [2], [5, 1]]
    batch = AttentionBatch.from_spans(tables, [(20, 40), (0, 3), (17, 18)], 16, torch.device("cpu"))
    layout = step_layout(batch)
    assert layout.qo_indptr.tolist() == [0, 20, 23, 24]
    assert layout.kv_indptr.tolist() == [0, 3, 4, 6]
    assert layout.kv_last_page_len.tolist() == [8, 3, 2]
    assert layout.kv_indices.tolist() == [9, 4, 6, 2, 5, 1]
    assert all(t.dtype == torch.int32 for t in vars(layout).values())
