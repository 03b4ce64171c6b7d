"""One AttentionBatch builder: the runner's step inputs, the kit's span batches, CUDA-graph buckets agree."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nanovllm_core import AttentionBackend, AttentionBatch, SamplingParams, SchedulerOutput
from nanovllm_core.engine.model_runner import flatten_batch, to_model_inputs
from nanovllm_core.sequence import Sequence

BLOCK = 16
CPU = torch.device("cpu")


def assert_same(a: AttentionBatch, b: AttentionBatch) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), name
        else:
            assert value == other, name


def test_the_runner_builds_what_from_spans_describes():
    """A mixed step (prompt chunk over cached context, a whole prompt, decode tokens) flattened by the runner
    gives the same batch as the spans it computes."""
    seqs, spans = [], [(20, 37), (0, 5), (40, 41), (16, 17)]
    tables = [[7, 2, 9], [4], [1, 3, 5, 8], [6, 0]]
    for (start, end), table in zip(spans, tables):
        seq = Sequence(list(range(1, end + 1)), SamplingParams())
        seq.num_computed_tokens, seq.block_table = start, table
        seqs.append(seq)
    batch = SchedulerOutput(seqs, [end - start for start, end in spans])
    inputs = to_model_inputs(flatten_batch(batch, BLOCK), BLOCK, CPU)
    want = AttentionBatch.from_spans(tables, spans, BLOCK, CPU)
    assert_same(inputs.attention, want)
    assert want.max_query_len == 17 and want.max_seq_len == 41 and want.num_tokens == 17 + 5 + 1 + 1
    assert want.block_tables.tolist()[1] == [4, 0, 0, 0]  # padded with 0
    # positions 20 and 36 of the first sequence: offset 4 of its second and third blocks
    assert want.slot_mapping[[0, 16]].tolist() == [2 * BLOCK + 4, 9 * BLOCK + 4]


def test_head_is_the_batch_of_the_first_sequences():
    tables, spans = [[3], [1, 2], [0, 4]], [(0, 4), (16, 18), (17, 18)]
    batch = AttentionBatch.from_spans(tables, spans, BLOCK, CPU)
    head = batch.head(2)
    want = AttentionBatch.from_spans(tables[:2], spans[:2], BLOCK, CPU)
    assert head.block_tables.data_ptr() == batch.block_tables.data_ptr()  # views, not copies
    assert_same(head, AttentionBatch(**{**vars(want), "max_seq_len": batch.max_seq_len}))


def test_build_takes_a_bound_and_tensors_as_they_are():
    tables = torch.zeros((4, 3), dtype=torch.int32)
    batch = AttentionBatch.build(list(range(5)), [0] * 4, tables, [-1] * 4, BLOCK, CPU, max_query_len=1, max_seq_len=48)
    assert batch.block_tables is tables and batch.max_seq_len == 48 and batch.max_query_len == 1
    assert batch.query_start_loc_cpu == [0, 1, 2, 3, 4] and batch.slot_mapping.tolist() == [-1] * 4
    assert batch.query_start_loc.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64


class _Recording(AttentionBackend):
    name = "recording"
    supports_cuda_graph = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batches: list[AttentionBatch] = []

    def build_metadata(self, batch: AttentionBatch) -> Any:
        self.batches.append(batch)
        return batch

    def forward(self, q, k, v, kv_cache, metadata):  # pragma: no cover - the toy model attends to nothing
        raise AssertionError("not called")


@pytest.mark.gpu
def test_cuda_graph_buckets_are_built_by_the_builder():
    from nanovllm_core.engine.cuda_graph import CudaGraphDecoder

    device = torch.device("cuda")
    backend = _Recording(
        num_heads=1, num_kv_heads=1, head_dim=8, scale=1.0, block_size=BLOCK, dtype=torch.float32, device=device
    )

    class Toy(nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return (input_ids * 10 + positions).float().unsqueeze(1).expand(-1, 4)

    graphs = CudaGraphDecoder(Toy(), backend, 20, 100, BLOCK, 4, torch.float32, device)
    assert [b.num_seqs for b in backend.batches] == list(reversed(graphs.sizes))
    for batch in backend.batches:
        bs = batch.num_seqs
        assert batch.query_start_loc_cpu == list(range(bs + 1)) and batch.seq_lens_cpu == [0] * bs
        assert (batch.max_query_len, batch.num_tokens, batch.max_seq_len) == (1, bs, 100)
        assert batch.seq_lens.data_ptr() == graphs.batch.seq_lens.data_ptr()  # the static buffers
    step = AttentionBatch.from_spans([[1], [2], [3]], [(4, 5), (0, 1), (9, 10)], BLOCK, device)
    hidden = graphs.run(torch.tensor([1, 2, 3], device=device), torch.tensor([4, 0, 9], device=device), step)
    assert hidden[:, 0].tolist() == [14.0, 20.0, 39.0]
    assert graphs.batch.seq_lens[:4].tolist() == [5, 1, 10, 0]  # the padding row of the 4-bucket attends nothing


def test_mixed_step_buffers_pad_each_step_to_its_bucket():
    """A step copied into the static batch of the mixed-step graphs: its rows and tokens, then padding rows (no
    query token, no context) and tokens owned by no sequence (slot -1), whatever an earlier, larger step left."""
    from nanovllm_core.engine.cuda_graph import MixedStepBuffers, mixed_token_sizes

    assert mixed_token_sizes(2048)[:7] == [16, 32, 64, 128, 256, 384, 512] and mixed_token_sizes(2048)[-1] == 2048
    assert mixed_token_sizes(100) == [16, 32, 64, 100] and mixed_token_sizes(8) == [8]
    device = torch.device("cpu")
    buffers = MixedStepBuffers(max_seqs=5, max_tokens=40, max_model_len=100, block_size=BLOCK, device=device)
    big = AttentionBatch.from_spans([[1, 2], [3], [4], [5]], [(0, 20), (0, 1), (4, 9), (9, 10)], BLOCK, device)
    assert buffers.can_run(big) and buffers.load(torch.arange(27), torch.arange(27), big) == 32
    step = AttentionBatch.from_spans([[6], [7]], [(3, 4), (0, 6)], BLOCK, device)
    assert buffers.can_run(step)
    assert buffers.load(torch.arange(7) + 100, torch.arange(7), step) == 16
    static = buffers.bucket(16)
    assert (static.num_tokens, static.num_seqs, static.max_query_len) == (16, 5, 16)
    assert static.query_start_loc.tolist() == [0, 1, 7, 7, 7, 7]
    assert static.seq_lens.tolist() == [4, 6, 0, 0, 0]
    assert static.slot_mapping.tolist() == step.slot_mapping.tolist() + [-1] * 9
    assert static.block_tables[:2, 0].tolist() == [6, 7]
    assert buffers.input_ids[:7].tolist() == list(range(100, 107))
    decode = AttentionBatch.from_spans([[1]], [(3, 4)], BLOCK, device)
    too_many = AttentionBatch.from_spans([[1]] * 6, [(0, 2)] * 6, BLOCK, device)
    too_long = AttentionBatch.from_spans([[1, 2, 3]], [(0, 41)], BLOCK, device)
    assert not any(buffers.can_run(b) for b in (decode, too_many, too_long))


def test_decode_step_buffers_pad_the_rows_of_its_batch_size_bucket():
    """The decode graphs' buffers (``decode=True``): one token per row, bucketed by batch size; the rows of the
    bucket past the step's attend nothing and store nothing, whatever an earlier, larger step left."""
    from nanovllm_core.engine.cuda_graph import MixedStepBuffers

    buffers = MixedStepBuffers(max_seqs=20, max_tokens=20, max_model_len=100, block_size=BLOCK,
                               device=torch.device("cpu"), decode=True)  # fmt: skip
    assert buffers.sizes == [1, 2, 4, 8, 16, 20] and (buffers.max_seqs, buffers.max_tokens) == (20, 20)
    big = AttentionBatch.from_spans([[1]] * 6, [(3, 4)] * 6, BLOCK, torch.device("cpu"))
    assert buffers.can_run(big) and buffers.load(torch.arange(6), torch.arange(6), big) == 8
    step = AttentionBatch.from_spans([[1], [2], [3]], [(4, 5), (0, 1), (9, 10)], BLOCK, torch.device("cpu"))
    prefill = AttentionBatch.from_spans([[1]], [(0, 2)], BLOCK, torch.device("cpu"))
    assert buffers.can_run(step) and not buffers.can_run(prefill)
    assert buffers.load(torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9]), step) == 4
    static = buffers.bucket(4)
    assert (static.num_seqs, static.num_tokens, static.max_query_len) == (4, 4, 1)
    assert static.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert static.seq_lens.tolist() == [5, 1, 10, 0]
    assert static.slot_mapping.tolist() == step.slot_mapping.tolist() + [-1]
    assert buffers.input_ids[:3].tolist() == [1, 2, 3] and buffers.positions[:3].tolist() == [4, 0, 9]
