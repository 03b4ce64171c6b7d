"""The ``triton`` backend's kernels in Triton's interpreter on CPU (float32), against the ``torch`` backend.

CPU tensors always run the interpreted kernels (``triton_kernels`` picks the variant by device), so these tests
need no ``TRITON_INTERPRET`` in the environment; it is set only around ``check_available`` calls, after
``triton`` is imported, so it cannot leak into other tests' kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_attention_flash import TorchAttentionBackend, TritonAttentionBackend, triton_kernels  # noqa: E402
from nanovllm_attention_flash.testing import make_case, record_tma_use, reference  # noqa: E402
from nanovllm_testing.conformance import AttentionBackendConformance  # noqa: E402

from nanovllm_core import ConfigError  # noqa: E402

# (query_lens, context_lens) of each step kind; lengths chosen to straddle 16- and 32-token blocks
KINDS = {
    "decode": ([1] * 5, [1, 15, 16, 40, 77]),
    "prefill": ([1, 7, 20, 45], [0] * 4),
    "prefix_hit": ([3, 17, 5], [16, 32, 64]),  # cached context is whole blocks (a prefix-cache hit)
    "chunked": ([9, 16, 30], [13, 37, 50]),  # chunks that start mid-block
    "mixed": ([1, 12, 1, 5, 1], [30, 0, 7, 21, 64]),  # prefill chunks beside decode tokens
}
GQA = {"mha": (2, 2), "gqa2": (4, 2), "gqa4": (4, 1)}


def assert_matches_torch(case, out: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "NaN in the output"
    torch.testing.assert_close(out, reference(case, TorchAttentionBackend), atol=2e-5, rtol=2e-5)


CASES = [(kind, heads, 16) for kind in KINDS for heads in GQA]
CASES += [(kind, "gqa4", 32) for kind in ("decode", "chunked", "mixed")]


@pytest.mark.parametrize("kind,heads,block_size", CASES, ids=[f"{k}-{h}-bs{b}" for k, h, b in CASES])
def test_matches_torch_backend(kind: str, heads: str, block_size: int) -> None:
    query_lens, context_lens = KINDS[kind]
    num_heads, num_kv_heads = GQA[heads]
    case = make_case(
        query_lens,
        context_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        num_pad_rows=2 if kind == "decode" else 0,
        seed=len(kind) + block_size,
    )
    backend = case.backend(TritonAttentionBackend)
    metadata = backend.build_metadata(case.batch)
    assert metadata.decode_only == (kind == "decode")
    if kind == "mixed":
        assert metadata.num_single_token_seqs == 3
    assert_matches_torch(case, case.run(backend))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 16])
def test_decode_split_counts(num_kv_splits: int) -> None:
    """One split (direct write), a few, and more splits than tiles (empty splits must merge to nothing)."""
    case = make_case([1] * 3, [3, 16, 97], num_heads=4, num_kv_heads=1, block_size=16, num_pad_rows=1)
    assert_matches_torch(case, case.run(case.backend(TritonAttentionBackend, num_kv_splits=num_kv_splits)))


def test_a_long_context_among_short_ones_is_split_and_merged_by_its_last_split() -> None:
    """One split a sequence on average: the batch's tiles are dealt out evenly, so the 300-token context among
    two-tile ones takes several splits (merged by the last to finish) and the others one each (written
    directly). The counters come back to zero, so the next call (another layer) merges right again."""
    case = make_case([1] * 6, [20, 300, 5, 31, 17, 0], num_heads=4, num_kv_heads=2, block_size=16, num_pad_rows=1)
    backend = case.backend(TritonAttentionBackend, num_kv_splits=1)
    cache = case.kv_cache.clone()
    for _ in range(2):
        assert_matches_torch(case, case.run(backend, cache))
        assert not backend._split_counters(case.batch.num_seqs).any()


def expected_plan(query_lens: list[int], seq_lens: list[int], splits: int, block_n: int) -> list[list[int]]:
    """The split plan's rows, dealt out in plain Python: equal splits of the decode rows' tiles, in batch order."""
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    tiles = [max(-(-n // block_n), 1) if q == 1 else 0 for q, n in zip(query_lens, seq_lens)]
    per_split = max(-(-sum(tiles) // (len(seq_lens) * splits)), 1)
    rows = []
    for i, (t, n) in enumerate(zip(tiles, seq_lens)):
        count, first = -(-t // per_split), len(rows)
        own_tiles = -(-n // block_n)
        for j in range(count):
            rows.append([i, starts[i], n, j * per_split, min(j * per_split + per_split, own_tiles), first, count])
    work_items = len(seq_lens) * (splits + 1)
    return rows + [[-1]] * (work_items - len(rows))


@pytest.mark.parametrize("splits", [1, 4])
def test_split_plan_deals_the_batch_tiles_into_equal_splits(splits: int) -> None:
    """A long context among short ones, a prefill row (no split), a padding row (one split of no tiles)."""
    query_lens, seq_lens = [1, 1, 7, 1, 1, 1], [20, 300, 9, 5, 31, 0]
    qsl = torch.tensor([sum(query_lens[:i]) for i in range(len(query_lens) + 1)], dtype=torch.int32)
    plan = triton_kernels.split_plan(torch.tensor(seq_lens, dtype=torch.int32), qsl, len(seq_lens), splits, 16)
    assert plan.shape == (len(seq_lens) * (splits + 1), triton_kernels.PLAN_FIELDS.value)
    got = [row[:7] if row[0] >= 0 else [-1] for row in plan.tolist()]
    assert got == expected_plan(query_lens, seq_lens, splits, 16)


def test_every_layer_of_a_step_reads_the_first_layers_plan() -> None:
    """The plan is made once a pass over the layers: another layer's call reuses it, a call on the layer that
    made it (the next pass: a capture after its warm-up) makes it again, from the lengths as they are then."""
    case = make_case([1] * 4, [20, 300, 5, 31], num_heads=4, num_kv_heads=2, block_size=16)
    backend = case.backend(TritonAttentionBackend, num_kv_splits=2)
    metadata = backend.build_metadata(case.batch)
    first_layer, second_layer = case.kv_cache.clone(), case.kv_cache.clone()
    assert_matches_torch(case, backend.forward(case.q, case.k, case.v, first_layer, metadata))
    plan = metadata.decode_plan
    assert_matches_torch(case, backend.forward(case.q, case.k, case.v, second_layer, metadata))
    assert metadata.decode_plan is plan
    case.batch.seq_lens[1] = 100
    backend.forward(case.q, case.k, case.v, first_layer, metadata)
    assert metadata.decode_plan is not plan
    assert 100 in metadata.decode_plan[:, 2].tolist() and 300 not in metadata.decode_plan[:, 2].tolist()


def test_mixed_batch_without_host_lengths() -> None:
    """Without ``query_start_loc_cpu`` the prefill kernel serves the one-token sequences of a mixed batch too."""
    case = make_case(*KINDS["mixed"], num_heads=4, num_kv_heads=2, block_size=16)
    case.batch.query_start_loc_cpu = []
    case.batch.seq_lens_cpu = []
    backend = case.backend(TritonAttentionBackend)
    assert backend.build_metadata(case.batch).num_single_token_seqs == 0
    out = case.run(backend)
    case.batch.query_start_loc_cpu = [0]
    for n in case.query_lens:
        case.batch.query_start_loc_cpu.append(case.batch.query_start_loc_cpu[-1] + n)
    case.batch.seq_lens_cpu = [c + n for c, n in zip(case.context_lens, case.query_lens)]
    assert_matches_torch(case, out)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_small_tiles_and_float16(use_tma: bool) -> None:
    """Non-default tiles through the options, and float16 storage with float32 accumulation."""
    case = make_case(*KINDS["chunked"], num_heads=4, num_kv_heads=2, block_size=32, dtype=torch.float16)
    backend = case.backend(
        TritonAttentionBackend, prefill_block_m=16, prefill_block_n=16, decode_block_n=16, prefill_use_tma=use_tma
    )
    out = case.run(backend).float()
    torch.testing.assert_close(out, reference(case, TorchAttentionBackend), atol=2e-3, rtol=2e-3)


TMA_CASES = [("prefill", 16, 16), ("prefix_hit", 32, 16), ("chunked", 32, 32), ("mixed", 16, 16)]


@pytest.mark.parametrize("kind,block_size,block_n", TMA_CASES, ids=[f"{k}-bs{b}-n{n}" for k, b, n in TMA_CASES])
def test_prefill_tma_matches_torch_backend(kind: str, block_size: int, block_n: int, monkeypatch) -> None:
    """The TMA variant (``prefill_use_tma``; descriptor loads emulated by the interpreter): ragged chunks whose
    diagonal tiles run past ``seq_len`` into never-written (NaN) slots, which must not reach the output."""
    used = record_tma_use(monkeypatch)
    case = make_case(*KINDS[kind], num_heads=4, num_kv_heads=2, block_size=block_size, seed=block_size + block_n)
    backend = case.backend(TritonAttentionBackend, prefill_use_tma=True, prefill_block_m=16, prefill_block_n=block_n)
    assert_matches_torch(case, case.run(backend))
    assert used == [True], "the prefill kernel should have taken the TMA path"


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_prefill_many_sequences_chunked_lookup(use_tma: bool, monkeypatch) -> None:
    """Programs find their sequence by counting ``query_start_loc`` entries ``SEQ_CHUNK`` at a time: with a chunk
    of 4, 11 sequences (one-token ones included, prefill kernel only) need three chunks, the last one partial."""
    monkeypatch.setattr(triton_kernels, "PREFILL_SEQ_CHUNK", 4)
    query_lens = [3, 1, 17, 2, 1, 9, 33, 1, 5, 16, 2]
    context_lens = [0, 5, 16, 0, 40, 3, 0, 17, 31, 16, 64]
    case = make_case(query_lens, context_lens, num_heads=4, num_kv_heads=1, block_size=16, seed=5)
    backend = case.backend(TritonAttentionBackend, prefill_block_m=16, prefill_block_n=16, prefill_use_tma=use_tma)
    assert_matches_torch(case, case.run(backend))  # one-token sequences left to the decode kernel
    host_starts = case.batch.query_start_loc_cpu
    case.batch.query_start_loc_cpu = []  # no host lengths: the prefill kernel serves the one-token sequences too
    out = case.run(backend)
    case.batch.query_start_loc_cpu = host_starts
    assert_matches_torch(case, out)


def test_tma_descriptors_need_a_packed_cache() -> None:
    """The 2-D view behind the TMA path needs whole blocks and heads packed; other layouts take the pointer path."""
    packed = torch.zeros(2, 4, 16, 2, 64)
    descriptors = triton_kernels.kv_tensor_descriptors(packed[0], packed[1], 16)
    assert descriptors is not None
    assert [list(d.shape) for d in descriptors] == [[64, 128], [64, 128]]
    assert [list(d.block_shape) for d in descriptors] == [[16, 64], [16, 64]]
    padded_heads = torch.zeros(2, 4, 16, 2, 80)[..., :64]
    assert triton_kernels.kv_tensor_descriptors(padded_heads[0], padded_heads[1], 16) is None


def test_store_skips_padding_slots() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([17, -1, 63])
    triton_kernels.store_kv(k, v, cache[0], cache[1], slots)
    flat = cache.view(2, 64, 2, 64)
    torch.testing.assert_close(flat[0, 17], k[0])
    torch.testing.assert_close(flat[1, 63], v[2])
    assert flat[:, [i for i in range(64) if i not in (17, 63)]].abs().sum() == 0


def test_invalid_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_kv_split"):
        make_case([1], [4]).backend(TritonAttentionBackend, num_kv_splits=3)
    with pytest.raises(ConfigError, match="decode_block_n"):
        make_case([1], [4], block_size=16).backend(TritonAttentionBackend, decode_block_n=32)
    with pytest.raises(ConfigError, match="attention_options"):
        make_case([1], [4]).backend(TritonAttentionBackend, not_an_option=1)


def test_check_available(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in TritonAttentionBackend.check_available(cpu, torch.float32, 128)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.check_available(cpu, torch.float32, 128) is None
    assert "head_dim" in TritonAttentionBackend.check_available(cpu, torch.float32, 96)


class TestTritonConformance(AttentionBackendConformance):
    """The core's conformance kit, with the kernels interpreted on CPU. Its batch checks run the GQA heads only:
    the kernels have no path of their own for one query head a KV head (``GROUP`` only sizes loops, masks and
    head indices), and ``test_matches_torch_backend``'s ``mha`` cases run that on every step kind."""

    backend_cls = TritonAttentionBackend

    def _setup(self):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            return super()._setup()

    @pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2)], ids=["gqa"])
    def test_ragged_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        super().test_ragged_batches_match_dense_attention(num_heads, num_kv_heads)

    @pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2)], ids=["gqa"])
    def test_graph_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        super().test_graph_batches_match_dense_attention(num_heads, num_kv_heads)


def test_a_sequence_of_more_splits_than_one_merge_block() -> None:
    """Alone, a 600-token context takes one split a tile: more splits than the merge reads at once (16), so the
    merge runs over several blocks of them."""
    case = make_case([1], [599], num_heads=4, num_kv_heads=2, block_size=16)
    backend = case.backend(TritonAttentionBackend, num_kv_splits=64)
    metadata = backend.build_metadata(case.batch)
    assert_matches_torch(case, backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), metadata))
    assert int(metadata.decode_plan[0, 6]) > 16
