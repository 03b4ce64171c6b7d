"""A step's inputs: the scheduled batch flattened into token ids, positions, KV slots and block tables (host
lists, then device tensors), the prompt positions it scores, and the runner's requests with their persistent
sampling state (:class:`InputBatch`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from nanovllm_core.distributed import broadcast_from_first, get_tp_rank
from nanovllm_core.host_tensor import host_tensor
from nanovllm_core.interfaces import AttentionBatch, SchedulerOutput
from nanovllm_core.layers.sampler import SamplingBatch, SamplingState
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    logits_indices: torch.Tensor  # which flattened tokens produce logits
    sample_rows: list[int]  # batch index of each logits row
    prompt_logits_indices: torch.Tensor | None = None  # flattened tokens whose logits score the next prompt token


@dataclass
class HostBatch:
    """One step's model inputs as plain lists: built once on rank 0, sent as is to tensor-parallel workers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    max_blocks: int
    max_query_len: int
    logits_indices: list[int]
    sample_rows: list[int]
    block_tables: list[int] = field(default_factory=list)  # flattened [num_seqs, max_blocks], padded with 0
    # async scheduling: input_ids[placeholder_dst[i]] is row placeholder_src[i] of the previous step's tokens
    placeholder_dst: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)
    # prompt_logprobs: flattened tokens whose logits give the logprob of the prompt token after them
    prompt_logits_indices: list[int] = field(default_factory=list)


def _flatten_decode(seqs: list[Sequence], bs: int) -> tuple[HostBatch, list[tuple[int, int]]]:
    """Pure decode, the common case, kept cheap."""
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
    seq_lens = [p + 1 for p in positions]
    sample_rows = [i for i, (seq, n) in enumerate(zip(seqs, seq_lens)) if n == len(seq.token_ids)]
    host = HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=[seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)],
        query_start_loc=list(range(len(seqs) + 1)),
        seq_lens=seq_lens,
        max_blocks=max(map(len, (seq.block_table for seq in seqs))),
        max_query_len=1,
        logits_indices=sample_rows,
        sample_rows=sample_rows,
    )
    return host, [(i, i) for i, token in enumerate(input_ids) if token == PLACEHOLDER_TOKEN]


def _flatten_mixed(batch: SchedulerOutput, bs: int) -> tuple[HostBatch, list[tuple[int, int]]]:
    host = HostBatch([], [], [], [0], [], 0, max(batch.num_new_tokens), [], [])
    input_ids, positions, slots = host.input_ids, host.positions, host.slot_mapping
    query_start_loc = host.query_start_loc
    placeholder_rows: list[tuple[int, int]] = []  # (flat index, batch row) of tokens still on the device
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        if n == 1:
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = table[pos // bs] * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + block_end))
                pos = block_end
        query_start_loc.append(query_start_loc[-1] + n)
        host.seq_lens.append(end)
        if len(table) > host.max_blocks:
            host.max_blocks = len(table)
        if end == seq.num_tokens:
            host.logits_indices.append(query_start_loc[-1] - 1)
            host.sample_rows.append(row)
            if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                placeholder_rows.append((query_start_loc[-1] - 1, row))
    return host, placeholder_rows


def flatten_batch(batch: SchedulerOutput, block_size: int, previous_rows: dict[int, int] | None = None) -> HostBatch:
    """Flatten a scheduled batch into token ids, positions, KV slots and block tables (host work).

    ``previous_rows`` maps ``seq_id`` to the row of the in-flight step's sampled tokens (async scheduling): a
    sequence whose last token is still :data:`PLACEHOLDER_TOKEN` takes its input from there, on the device.
    """
    seqs = batch.seqs
    if max(batch.num_new_tokens) == 1:
        host, placeholder_rows = _flatten_decode(seqs, block_size)
    else:
        host, placeholder_rows = _flatten_mixed(batch, block_size)
    if placeholder_rows:
        if previous_rows is None:
            raise RuntimeError("a scheduled token is a placeholder but no step is in flight to supply it")
        host.placeholder_dst = [dst for dst, _ in placeholder_rows]
        host.placeholder_src = [previous_rows[seqs[row].seq_id] for _, row in placeholder_rows]
    flat_tables = host.block_tables
    zeros = [0] * host.max_blocks
    for seq in seqs:
        flat_tables.extend(seq.block_table)
        flat_tables.extend(zeros[len(seq.block_table) :])
    return host


@dataclass
class PromptLogprobsPlan:
    """The prompt positions one step scores, for the rows whose request asks ``prompt_logprobs``.

    Row ``rows[i]`` scores prompt tokens ``first_positions[i] .. first_positions[i] + counts[i] - 1`` (each
    given the tokens before it) and keeps ``num_top[i]`` top tokens; ``targets`` are those prompt tokens, all
    rows concatenated, in the order of ``HostBatch.prompt_logits_indices``.
    """

    rows: list[int] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)


def causal_pairs(counts: Iterable[int], cached: Iterable[int]) -> float:
    """The query-key pairs of prompt chunks' causal attention: a chunk of ``n`` tokens after ``c`` cached ones
    attends to ``n * c + n * (n + 1) / 2`` keys; single tokens (decodes) count none. The runner records them per
    step, the simulator's step-time model prices them."""
    return float(sum(n * (c + (n + 1) / 2) for n, c in zip(counts, cached) if n > 1))


def prompt_pairs(host: HostBatch) -> float:
    """:func:`causal_pairs` of a flattened step."""
    if len(host.input_ids) == len(host.seq_lens):
        return 0.0
    starts = host.query_start_loc
    counts = [b - a for a, b in zip(starts, starts[1:])]
    return causal_pairs(counts, [length - n for n, length in zip(counts, host.seq_lens)])


def one_token_rows(host: HostBatch) -> int:
    """Rows of a flattened step with one query token: its decodes (and any prompt chunk of one token)."""
    starts = host.query_start_loc
    if len(host.input_ids) == len(host.seq_lens):
        return len(host.seq_lens)
    return sum(1 for a, b in zip(starts, starts[1:]) if b - a == 1)


def plan_prompt_logprobs(batch: SchedulerOutput, host: HostBatch) -> PromptLogprobsPlan | None:
    """Which prompt tokens this step can score, and the flattened tokens whose logits score them (appended to
    ``host.prompt_logits_indices``); ``None`` when no row asks (the common case, found without a pass in
    decode steps).

    A row computing positions ``[start, end)`` has the logits of position ``q`` for the token at ``q + 1``:
    it scores prompt tokens ``start + 1 .. min(end, num_prompt_tokens - 1)``. Over the chunks of a prompt that
    covers every prompt token but the first, provided the first chunk starts at 0 (no prefix-cache hit).
    """
    if host.max_query_len == 1 and len(host.sample_rows) == len(batch.seqs):
        return None  # every row computes its last token: no prompt token is left to score
    plan = None
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        num_top = seq.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        start = seq.num_computed_tokens
        last = min(start + n, seq.num_prompt_tokens - 1)
        if last <= start:
            continue
        plan = plan or PromptLogprobsPlan()
        plan.rows.append(row)
        plan.first_positions.append(start + 1)
        plan.counts.append(last - start)
        plan.num_top.append(num_top)
        plan.targets += seq.token_ids[start + 1 : last + 1]
        flat = host.query_start_loc[row]
        host.prompt_logits_indices += range(flat, flat + last - start)
    return plan


def to_model_inputs(
    host: HostBatch, block_size: int, device: torch.device, previous_tokens: torch.Tensor | None = None
) -> ModelInputs:
    attention = AttentionBatch.build(
        host.query_start_loc,
        host.seq_lens,
        host_tensor(host.block_tables, torch.int32, device).view(len(host.seq_lens), host.max_blocks),
        host.slot_mapping,
        block_size,
        device,
        max_query_len=host.max_query_len,
    )
    input_ids = host_tensor(host.input_ids, torch.int64, device)
    if host.placeholder_dst:
        dst = host_tensor(host.placeholder_dst, torch.int64, device)
        if previous_tokens is not None:
            tokens = previous_tokens[host_tensor(host.placeholder_src, torch.int64, device)]
        elif get_tp_rank() > 0:  # a tensor-parallel worker: only rank 0 samples; its tokens come below
            tokens = torch.empty(len(host.placeholder_dst), dtype=torch.int64, device=device)
        else:
            raise RuntimeError("the step has placeholder tokens but no previous step's sampled tokens were given")
        # async scheduling under tensor parallelism: every rank needs the in-flight step's tokens, which exist
        # only on rank 0's device; one small device-side broadcast, ordered after the sampling (no host sync)
        broadcast_from_first(tokens)
        input_ids.index_copy_(0, dst, tokens)
    return ModelInputs(
        input_ids=input_ids,
        positions=host_tensor(host.positions, torch.int64, device),
        attention=attention,
        logits_indices=host_tensor(host.logits_indices, torch.int64, device),
        sample_rows=host.sample_rows,
        prompt_logits_indices=(
            host_tensor(host.prompt_logits_indices, torch.int64, device) if host.prompt_logits_indices else None
        ),
    )


def prepare_inputs(batch: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    return to_model_inputs(flatten_batch(batch, block_size), block_size, device)


class InputBatch:
    """The runner's requests (vLLM's ``InputBatch``): each sequence that samples holds a slot of persistent
    sampling state (:class:`SamplingState`) from its first sampled step on; the slots of finished sequences are
    given back when new ones join."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.state = SamplingState(vocab_size, device)
        self.slot_of: dict[int, int] = {}  # seq_id -> slot
        self.seqs: dict[int, Sequence] = {}  # seq_id -> the sequence holding a slot

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampling parameters of ``seqs`` (the rows that sample this step), new ones added first."""
        slot_of = self.slot_of
        slots = [slot_of.get(seq.seq_id, -1) for seq in seqs]
        if -1 in slots:
            current = {seq.seq_id for seq in seqs}
            done = [i for i, seq in self.seqs.items() if seq.is_finished and i not in current]
            if done:
                self.state.remove([slot_of.pop(i) for i in done])
                for i in done:
                    del self.seqs[i]
            new = [seq for seq, slot in zip(seqs, slots) if slot < 0]
            for seq, slot in zip(new, self.state.add(new)):
                slot_of[seq.seq_id] = slot
                self.seqs[seq.seq_id] = seq
            slots = [slot_of[seq.seq_id] for seq in seqs]
        return self.state.batch(seqs, slots)
