"""SimulatedEngine: the real engine core driving a scheduler and a block manager, with a fake model.

The fake model's next token depends on every token before it, and the simulated KV cache records, for each
slot, a fingerprint of the whole prefix whose key/value it holds. So a block freed too early, handed to two
sequences, or found by a wrong prefix-cache hit gives a wrong context, which every step checks, naming the
request, the step and the rule. The engine core checks the scheduler's output every step (limits, block
tables covering the new tokens), exactly as it does with a real model; async scheduling works as on a GPU
(placeholder tokens, the previous step's tokens fed in).

Time is simulated: a :class:`StepCost` gives each step's duration on the device (zero by default; ``nanovllm
simulate`` passes a GPU calibration). With async scheduling step N+1 is scheduled while step N runs: the host
schedules it once step N-1's tokens are read, and it starts on the device when step N ends. ``checked=False``
drops the fake model and the per-token checks (every token is :data:`EMITTED_TOKEN`) for long simulations.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.core import EngineCore
from nanovllm_core.engine.input_batch import causal_pairs
from nanovllm_core.engine.options import instantiate
from nanovllm_core.interfaces import BlockManager, Scheduler, SchedulerOutput
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence

__all__ = ["EMITTED_TOKEN", "SIM_VOCAB", "SimulatedEngine", "StepCost", "fake_next_token", "random_tokens"]

SIM_VOCAB = 997
EMITTED_TOKEN = 1  # every token of an unchecked simulation; its requests ignore EOS and stop at max_tokens


class StepCost(Protocol):
    """A step's duration on the simulated device, and the host's time between two steps."""

    host_gap_ms: float  # host work per step that async scheduling does not hide

    def step_ms(
        self, seqs: int, query_tokens: int, kv_tokens: int, prompt_pairs: float = 0.0, decode_rows: int | None = None
    ) -> float: ...


class _NoCost:
    host_gap_ms = 0.0

    def step_ms(
        self, seqs: int, query_tokens: int, kv_tokens: int, prompt_pairs: float = 0.0, decode_rows: int | None = None
    ) -> float:
        return 0.0


def _fail(message: str) -> NoReturn:
    """Fail the running pytest check; a simulation driven without pytest installed raises AssertionError."""
    try:
        import pytest
    except ModuleNotFoundError:
        raise AssertionError(message) from None
    pytest.fail(message)


def random_tokens(n: int, rng: random.Random, vocab: int = SIM_VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def tokens(n: int, start: int = 0) -> list[int]:
    """``n`` consecutive token ids from ``start``: prompts that share no prefix unless their ranges overlap."""
    return list(range(start, start + n))


def _extend(fingerprint: int, token: int) -> int:
    return (fingerprint * 1_000_003 + token + 1) % (1 << 61)


def fake_next_token(token_ids: list[int]) -> int:
    """The fake model: the next token is a function of every token before it."""
    fingerprint = 0
    for token in token_ids:
        fingerprint = _extend(fingerprint, token)
    return fingerprint % SIM_VOCAB


class _FakeStep:
    """A launched step: the tokens it samples, when the device finishes it, and whose token times receive that."""

    __slots__ = ("batch", "sampled", "end", "sim", "receivers")

    def __init__(
        self, batch: SchedulerOutput, sampled: list[int | None], end: float, sim: SimulatedEngine,
        receivers: list[list[float]],
    ) -> None:
        self.batch, self.sampled, self.end, self.sim, self.receivers = batch, sampled, end, sim, receivers

    def tokens(self) -> list[int | None]:
        end, sim = self.end, self.sim
        for token_times in self.receivers:
            token_times.append(end)
        if end > sim.read_until:
            sim.read_until = end
        if sim.on_read is not None:
            sim.on_read(end, self.receivers)
        return self.sampled


class _FakeRunner:
    """Runs a step on no device: the fake model's tokens (checked on the simulated KV cache, failing the test when a
    context is not really in the cache) or fixed ones, and the step's device interval from the step cost.

    Unchecked, it is one pass over the batch and no per-token work: a simulation runs it for hours of traffic."""

    def __init__(self, sim: SimulatedEngine) -> None:
        self.sim = sim
        self.kv: dict[int, int] = {}
        self._fingerprints: dict[int, list[int]] = {}

    def launch(self, batch: SchedulerOutput, in_flight: _FakeStep | None = None) -> _FakeStep:
        sim = self.sim
        seqs, counts = batch.seqs, batch.num_new_tokens
        if sim.record_steps:
            sim.batch_sizes.append((len(seqs), batch.total_new_tokens))
            sim.scheduled.append([(seq.request_id, n) for seq, n in zip(seqs, counts)])
            sim.preempted.append([seq.request_id for seq in batch.preempted])
        contexts = self._check(batch, in_flight) if sim.checked else None
        query = sum(counts)
        # one pass: the KV tokens after the step, and a token for each sequence whose chunk reaches its last token
        # (decodes, and prompts' last chunks), which lands in its request's token times (if it has any)
        kv_tokens = query
        sampled: list[int | None] = []
        receivers: list[list[float]] = []
        token_times = sim.token_times
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            start = seq.num_computed_tokens
            kv_tokens += start
            if start + n == len(seq.token_ids):
                sampled.append(EMITTED_TOKEN if contexts is None else fake_next_token(contexts[i]))
                times = token_times.get(seq.request_id)
                if times is not None:
                    receivers.append(times)
            else:
                sampled.append(None)
        pairs = 0.0
        if query > len(seqs):  # some prompt chunk: its causal attention's query-key pairs
            pairs = causal_pairs(counts, [seq.num_computed_tokens for seq in seqs])
        decode_rows = sum(1 for n in counts if n == 1)
        duration = sim.step_cost.step_ms(len(seqs), query, kv_tokens, pairs, decode_rows) / 1e3
        begin = max(sim.now, sim.gpu_free)
        sim.gpu_free = begin + duration
        sim.gpu_busy += duration
        return _FakeStep(batch, sampled, sim.gpu_free, sim, receivers)

    def _tokens(self, seq: Sequence, in_flight_tokens: dict[int, int]) -> list[int]:
        tokens = seq.token_ids
        if tokens[-1] == PLACEHOLDER_TOKEN:  # async scheduling: the in-flight step samples it
            assert seq.seq_id in in_flight_tokens, (
                f"{seq!r} ends in a placeholder token but the step in flight samples nothing for it"
            )
            tokens = tokens[:-1] + [in_flight_tokens[seq.seq_id]]
        return tokens

    def _prefix_fingerprints(self, seq: Sequence, tokens: list[int]) -> list[int]:
        fps = self._fingerprints.setdefault(seq.seq_id, [])
        while len(fps) < len(tokens):
            fps.append(_extend(fps[-1] if fps else 0, tokens[len(fps)]))
        return fps

    def _check(self, batch: SchedulerOutput, in_flight: _FakeStep | None) -> list[list[int]]:
        """Writes the step's keys/values into the simulated cache and checks every context read; returns each
        sequence's tokens (the in-flight step's tokens in place of placeholders)."""
        sim, step = self.sim, self.sim.steps
        bs = sim.block_size
        for seq in batch.preempted:
            if all(seq is not s for s in batch.seqs):
                assert not seq.block_table, f"step {step}: {sim.name} preempted {seq!r} but it still holds blocks"
        in_flight_tokens = {}
        if in_flight is not None:
            in_flight_tokens = {s.seq_id: t for s, t in zip(in_flight.batch.seqs, in_flight.sampled) if t is not None}
        written: dict[int, tuple[int, str]] = {}
        contexts = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            table = seq.block_table
            assert all(0 <= b < sim.num_blocks for b in table), f"step {step}: block table {table} out of range"
            assert len(set(table)) == len(table), f"step {step}: block table {table} repeats a block"
            tokens = self._tokens(seq, in_flight_tokens)
            fps = self._prefix_fingerprints(seq, tokens)
            contexts.append((tokens, fps))
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                slot = table[p // bs] * bs + p % bs
                other = written.get(slot)
                if other is not None and other[0] != fps[p]:
                    _fail(
                        f"step {step}: requests {other[1]!r} and {seq.request_id!r} write different keys/values "
                        f"into block {slot // bs} in the same step: a block is shared that must not be"
                    )
                written[slot] = (fps[p], seq.request_id)
        for slot, (fp, _) in written.items():
            self.kv[slot] = fp
        for (seq, n), (_, fps) in zip(zip(batch.seqs, batch.num_new_tokens), contexts):
            start = seq.num_computed_tokens
            for p in range(start):
                slot = seq.block_table[p // bs] * bs + p % bs
                if self.kv.get(slot) != fps[p]:
                    state = "was never written" if slot not in self.kv else "holds another sequence's keys/values"
                    _fail(
                        f"step {step}: request {seq.request_id!r} computes tokens [{start}, {start + n}) but the "
                        f"cache slot of its token {p} (block {seq.block_table[p // bs]}) {state}. Its context is not "
                        "in the KV cache: a block was freed or reused while still needed, a prefix-cache hit handed "
                        "out a wrong block, or num_computed_tokens was not reset after a preemption"
                    )
        return [tokens for tokens, _ in contexts]


class SimulatedEngine:
    """Drives a scheduler and a block manager through :class:`~nanovllm_core.engine.core.EngineCore`.

    ``add`` / ``abort`` / ``step`` / ``run`` as on the engine, plus the checks: exact outputs (the fake
    model's completion of each prompt alone), block accounting after every step (used blocks are exactly the
    union of the live block tables) and every block free at the end. ``step_cost`` times the steps on the
    simulated clock (``now``, the host's; ``gpu_free``, when the device finishes the last launched step);
    ``checked=False`` keeps the clock and drops the fake model and the checks; ``record_steps=False`` keeps no
    per-step lists.
    """

    def __init__(
        self,
        scheduler_cls: type[Scheduler],
        block_manager_cls: type[BlockManager],
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = False,
        scheduler_options: dict[str, Any] | None = None,
        block_manager_options: dict[str, Any] | None = None,
        step_cost: StepCost | None = None,
        checked: bool = True,
        record_steps: bool = True,
        name: str | None = None,
    ) -> None:
        self.config = EngineConfig(
            model="(simulated)",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kvcache_block_size=block_size,
            num_kvcache_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # as the engine builds them: validated options as keyword arguments
        self.block_manager: BlockManager = instantiate(
            "block_manager", block_manager_cls, dict(block_manager_options or {}), num_blocks, block_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler: Scheduler = instantiate(
            "scheduler", scheduler_cls, dict(scheduler_options or {}), self.config, self.block_manager
        )
        self.name = name or type(self.scheduler).__name__
        self.step_cost: StepCost = step_cost or _NoCost()
        self.checked = checked
        self.record_steps = record_steps
        self.runner = _FakeRunner(self)
        self.core = EngineCore(
            self.config, self.scheduler, self.runner, scheduler_name=self.name, async_scheduling=async_scheduling
        )
        self.live: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []  # in the order they finished
        self.aborted: list[Sequence] = []
        self.prompts: dict[str, list[int]] = {}
        self.steps = 0
        self.batch_sizes: list[tuple[int, int]] = []  # (sequences, new tokens) per step
        self.scheduled: list[list[tuple[str, int]]] = []  # (request id, new tokens) of each launched step
        self.preempted: list[list[str]] = []  # request ids each launched step preempted
        self.now = 0.0  # the host's clock, simulated seconds
        self.gpu_free = 0.0  # when the device finishes the last launched step
        self.gpu_busy = 0.0
        self.read_until = 0.0  # the end of the latest step whose tokens the host read
        # request id -> where its tokens' times land (the host's reading of the step that sampled each)
        self.token_times: dict[str, list[float]] = {}
        # called as the host reads each step's tokens: (the step's end, the token-times lists it appended to)
        self.on_read: Callable[[float, list[list[float]]], None] | None = None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # --- requests -------------------------------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int, request_id: str | None = None, **params: Any) -> Sequence:
        """Add a greedy request (EOS ignored); ``params`` are further SamplingParams (e.g. ``priority``)."""
        request_id = self.core.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params), request_id
        )
        seq = self.core._requests[request_id].seqs[0]
        self.live[request_id] = seq
        self.prompts[request_id] = list(prompt)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.live.get(request_id)
        out = self.core.abort_request(request_id)
        assert (out is None) == (seq is None), f"abort({request_id!r}) of a {'live' if seq else 'unknown'} request"
        if seq is not None:
            assert not seq.block_table, f"{self.name}: abort({request_id!r}) left blocks {seq.block_table}"
            del self.live[request_id]
            self.aborted.append(seq)
        self.check_block_accounting(f"after abort({request_id!r})")
        return seq

    # --- stepping -------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences added with ``add`` that finished in it."""
        self.steps += 1
        done = []
        for out in self.core.step():
            if out.finished and out.request_id in self.live:
                seq = self.live.pop(out.request_id)
                assert seq.is_finished and seq.finish_reason, f"step {self.steps}: {out.request_id!r} is {seq!r}"
                assert not seq.block_table, (
                    f"step {self.steps}: finished request {out.request_id!r} still holds blocks {seq.block_table}"
                )
                self.finished.append(seq)
                done.append(seq)
        # the host waited for the tokens it read, then spends its per-step time; without async scheduling it
        # waited for this step too
        self.now = max(self.now, self.read_until) + self.step_cost.host_gap_ms / 1e3
        if not self.core.async_scheduling:
            self.now = max(self.now, self.gpu_free)
        if self.checked:
            self.check_block_accounting(f"after step {self.steps}")
        return done

    def run(self, max_steps: int = 10_000) -> None:
        """Step until every request finished; fails if that takes more than ``max_steps`` steps."""
        for _ in range(max_steps):
            if not self.core.has_unfinished_requests():
                break
            self.step()
        else:
            _fail(
                f"{self.name}: {len(self.live)} requests still unfinished after {max_steps} steps "
                f"(starvation or a livelock): {sorted(self.live.values(), key=lambda s: s.seq_id)[:5]}"
            )
        assert not self.live, f"the engine has no unfinished request but {sorted(self.live)} never came back"

    def check_block_accounting(self, when: str) -> None:
        """Used blocks are exactly the union of the block tables of the unfinished requests."""
        used: set[int] = set()
        for seq in self.live.values():
            used.update(seq.block_table)
        bm = self.block_manager
        assert bm.num_free_blocks == self.num_blocks - len(used), (
            f"{when}: {type(bm).__name__}.num_free_blocks is {bm.num_free_blocks}, but the unfinished requests "
            f"hold {len(used)} of {self.num_blocks} blocks (a block leaked or was freed while in use)"
        )

    # --- results --------------------------------------------------------------------------------------

    @staticmethod
    def expected_completion(prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(fake_next_token(tokens))
        return tokens[len(prompt) :]

    def assert_outputs_exact(self) -> None:
        """Every finished request's completion is what the fake model produces for its prompt alone."""
        for seq in self.finished:
            want = self.expected_completion(self.prompts[seq.request_id], seq.sampling_params.max_tokens)
            got = seq.completion_token_ids
            if got != want:
                where = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise AssertionError(
                    f"request {seq.request_id!r} (preempted {seq.num_preemptions} times): first difference at "
                    f"output token {where} (got {got[where:where + 3]}, expected {want[where:where + 3]})"
                )

    def assert_all_blocks_free(self) -> None:
        bm = self.block_manager
        assert bm.num_free_blocks == bm.num_blocks == self.num_blocks, (
            f"every request finished but {type(bm).__name__} has {bm.num_free_blocks} of {self.num_blocks} blocks free"
        )
