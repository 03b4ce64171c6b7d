"""The scheduler kit: :class:`SchedulerConformance`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.interfaces import BlockManager, Scheduler
from nanovllm_core.plugins import check_registration, get_registry
from nanovllm_testing.conformance._shared import (
    assert_done,
    assert_matches_transformers,
    fixture,
    installed_plugin,
    registered_for_test,
    run_engine,
    shared_checkpoint_fixture,
)
from nanovllm_testing.simulated import SimulatedEngine, random_tokens

if TYPE_CHECKING:
    import pytest


class SchedulerConformance:
    """Checks a :class:`~nanovllm_core.Scheduler` policy; set ``scheduler_cls`` in a ``Test...`` subclass.

    Every scenario runs through :class:`SimulatedEngine` (the real engine core with a fake model), with and
    without async scheduling. The block manager is ``block_manager_cls`` or the installed
    ``block_manager_name`` (``prefix_cache``). Only ``test_engine_greedy_outputs_under_kv_pressure`` needs a
    model plugin (Qwen3) and the ``attention`` backend: it is skipped, saying so, when they are not installed.
    """

    scheduler_cls: ClassVar[type[Scheduler]]
    scheduler_options: ClassVar[dict[str, Any]] = {}
    block_manager_cls: ClassVar[type[BlockManager] | None] = None
    block_manager_name: ClassVar[str] = "prefix_cache"
    block_manager_options: ClassVar[dict[str, Any]] = {}
    expect_prefix_cache_hits: ClassVar[bool] = True
    starvation_bound_steps: ClassVar[int] = 200
    attention: ClassVar[str] = "torch"
    block_size: ClassVar[int] = 16

    @fixture(params=[False, True], ids=["sync", "async"])
    def async_scheduling(self, request: pytest.FixtureRequest) -> bool:
        return request.param

    def get_block_manager_cls(self) -> type[BlockManager]:
        if self.block_manager_cls is not None:
            return self.block_manager_cls
        return installed_plugin("block_manager", self.block_manager_name, "block_manager_cls").obj

    def simulate(self, num_blocks: int, async_scheduling: bool = False, **kwargs: Any) -> SimulatedEngine:
        """A :class:`SimulatedEngine` of this scheduler; ``kwargs`` override its limits and options."""
        kwargs = {
            "block_size": self.block_size, "scheduler_options": self.scheduler_options,
            "block_manager_options": self.block_manager_options, **kwargs,
        }
        return SimulatedEngine(
            self.scheduler_cls, self.get_block_manager_cls(), num_blocks=num_blocks,
            async_scheduling=async_scheduling, **kwargs,
        )

    conformance_checkpoint = shared_checkpoint_fixture()

    def test_is_a_scheduler(self) -> None:
        problem = check_registration("scheduler", self.scheduler_cls)
        assert problem is None, problem

    def test_token_budget_and_max_num_seqs(self, async_scheduling: bool) -> None:
        """Mixed prompt and output lengths, prompts longer than the budget: limits hold in every step."""
        sim = self.simulate(num_blocks=64, async_scheduling=async_scheduling, max_num_seqs=3, max_num_batched_tokens=48)
        rng = random.Random(0)
        for _ in range(12):
            sim.add(random_tokens(rng.randint(5, 90), rng), rng.randint(1, 20))
        sim.run()
        assert_done(sim, 12)

    def test_long_prompts_in_many_chunks_mixed_with_decodes(self, async_scheduling: bool) -> None:
        """Prompts of 3 to 6 budgets arrive while others decode: every chunk stays within the budget."""
        sim = self.simulate(num_blocks=48, async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=24)
        rng = random.Random(10)
        for wave in range(4):
            sim.add(random_tokens(rng.randint(3 * 24, 6 * 24), rng), rng.randint(2, 12))
            sim.add(random_tokens(rng.randint(2, 10), rng), rng.randint(5, 25))
            for _ in range(3 + wave):
                if sim.core.has_unfinished_requests():
                    sim.step()
        sim.run()
        assert len(sim.finished) == 8, f"{len(sim.finished)} of 8 requests finished"
        assert max(tokens for _, tokens in sim.batch_sizes) <= 24 and max(n for n, _ in sim.batch_sizes) <= 4
        assert_done(sim)

    def test_prefix_hits_with_chunked_admission_and_few_blocks(self, async_scheduling: bool) -> None:
        """Prompts sharing cached prefixes longer than the budget, admitted in chunks, with the cache nearly full
        (the case where a misread ``allocate`` schedules 0-token or uncovered chunks)."""
        bs = self.block_size
        sim = self.simulate(
            num_blocks=12, async_scheduling=async_scheduling, max_num_seqs=3, max_num_batched_tokens=bs + 5
        )
        rng = random.Random(11)
        shared = random_tokens(4 * bs, rng)
        sim.add(shared + random_tokens(3, rng), 4)
        sim.run()
        for i in range(6):
            sim.add(shared[: (1 + i % 4) * bs] + random_tokens(rng.randint(1, 2 * bs), rng), rng.randint(1, 10))
        sim.run()
        assert_done(sim, 7)

    def test_request_that_can_never_fit_is_rejected(self) -> None:
        import pytest
        sim = self.simulate(num_blocks=4)
        rng = random.Random(1)
        with pytest.raises(InvalidRequestError):
            sim.add(random_tokens(5 * self.block_size, rng), 4)
        assert not sim.scheduler.has_unfinished(), "a rejected request must leave the scheduler unchanged"
        sim.add(random_tokens(20, rng), 4)
        sim.run()
        assert_done(sim)

    def test_no_starvation_under_a_stream_of_requests(self, async_scheduling: bool) -> None:
        """A long request added first finishes while shorter ones keep arriving, one per step."""
        sim = self.simulate(num_blocks=40, async_scheduling=async_scheduling, max_num_seqs=8, max_num_batched_tokens=64)
        rng = random.Random(2)
        first = sim.add(random_tokens(48, rng), 4)
        for _ in range(3):
            sim.add(random_tokens(20, rng), 4)
        for _ in range(self.starvation_bound_steps):
            if first.is_finished:
                break
            sim.add(random_tokens(20, rng), 4)
            sim.step()
        assert first.is_finished, (
            f"the first request (48-token prompt) did not finish within {self.starvation_bound_steps} steps "
            f"while 20-token requests kept arriving: it is starved ({first!r})"
        )
        sim.run()
        assert_done(sim)

    def test_abort_anywhere_frees_blocks(self, async_scheduling: bool) -> None:
        """Abort requests at random points (waiting, mid-prompt, decoding, just finished); the rest finish."""
        sim = self.simulate(num_blocks=24, async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=32)
        rng = random.Random(3)
        for _ in range(16):
            sim.add(random_tokens(rng.randint(5, 70), rng), rng.randint(1, 30))
        ids = list(sim.live)
        while sim.core.has_unfinished_requests():
            sim.step()
            if rng.random() < 0.3 and sim.live:
                victim = rng.choice(sorted(sim.live))
                seq = sim.live[victim]
                assert sim.abort(victim) is seq, f"abort({victim!r}) did not return the request"
                assert sim.abort(victim) is None, "a second abort of the same request must return None"
        assert sim.abort("no-such-request") is None, "abort of an unknown request must return None"
        assert len(sim.finished) + len(sim.aborted) == len(ids)
        assert sim.aborted, "the scenario aborted nothing"
        assert_done(sim)
        assert sim.abort(sim.finished[0].request_id) is None, "abort of a finished request must return None"

    def test_preemption_under_kv_pressure_keeps_outputs(self, async_scheduling: bool) -> None:
        """The cache holds the largest request but not all of them: every output is still exact."""
        sim = self.simulate(num_blocks=6, async_scheduling=async_scheduling, max_num_seqs=8, max_num_batched_tokens=64)
        rng = random.Random(4)
        for n in (30, 25, 40, 18, 33, 27):
            sim.add(random_tokens(n, rng), 40)
        sim.run()
        assert_done(sim, 6)

    def test_forced_preemption_frees_the_victims_blocks(self, async_scheduling: bool) -> None:
        """Two prompts of two blocks each fill a four-block cache and each needs a third block for its first
        decode token, so a policy that runs both at once must preempt one. The victim is left with no blocks and
        nothing computed, every block is accounted for after each step and both outputs are exact."""
        bs = self.block_size
        sim = self.simulate(
            num_blocks=4, async_scheduling=async_scheduling, max_num_seqs=2, max_num_batched_tokens=4 * bs
        )
        rng = random.Random(13)
        seqs = [sim.add(random_tokens(2 * bs, rng), bs, request_id=f"r{i}") for i in range(2)]
        while sim.core.has_unfinished_requests():
            counts = [seq.num_preemptions for seq in seqs]
            sim.step()
            for victim, count in zip(seqs, counts):
                if victim.num_preemptions == count or victim.seq_id in sim.scheduler.running or victim.is_finished:
                    continue  # not preempted in this step, or admitted again in it
                assert not victim.block_table and victim.num_computed_tokens == 0, (
                    f"step {sim.steps}: {victim!r} was preempted but holds blocks {victim.block_table} and "
                    f"{victim.num_computed_tokens} computed tokens: Scheduler.preempt frees the blocks and resets both"
                )
        assert_done(sim, 2)

    def test_limits_hold_when_decodes_and_prompt_chunks_share_steps(self, async_scheduling: bool) -> None:
        """Requests arrive every other step while others decode, with token budgets down to one token per seat:
        wherever a policy puts decode tokens and prompt chunks in the same step, the step keeps
        ``max_num_batched_tokens`` and ``max_num_seqs`` (the engine checks every step) and every request finishes."""
        for max_num_seqs, budget in ((4, 4), (4, 5), (3, 2 * self.block_size)):
            sim = self.simulate(
                num_blocks=48, async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
            )
            rng = random.Random(12)
            for i in range(24):
                if i % 2 == 0:
                    sim.add(random_tokens(rng.randint(1, 3 * budget), rng), rng.randint(1, 10))
                if sim.core.has_unfinished_requests():
                    sim.step()
            sim.run()
            assert len(sim.finished) == 12, f"max_num_seqs={max_num_seqs}, budget={budget}: {len(sim.finished)} of 12"
            assert_done(sim)

    def test_prefix_cache_hits_are_reported(self) -> None:
        """A prompt sharing full blocks with a finished one reports exactly those tokens as cached."""
        import pytest
        if not self.expect_prefix_cache_hits:
            pytest.skip("expect_prefix_cache_hits = False")
        bs = self.block_size
        sim = self.simulate(num_blocks=32)
        rng = random.Random(5)
        shared = random_tokens(2 * bs, rng)
        sim.add(shared + random_tokens(5, rng), 3)
        sim.run()
        second = sim.add(shared + random_tokens(7, rng), 3)
        third = sim.add(shared[:bs] + random_tokens(20, rng), 3)
        sim.run()
        assert second.num_cached_prompt_tokens == 2 * bs, (
            f"a prompt sharing 2 full blocks with an earlier one reported {second.num_cached_prompt_tokens} cached "
            f"tokens, expected {2 * bs}: does the policy admit new sequences through allocate_chunk?"
        )
        assert third.num_cached_prompt_tokens == bs, (
            f"a prompt sharing 1 full block reported {third.num_cached_prompt_tokens} cached tokens, expected {bs}"
        )
        stats = sim.core.stats()
        assert stats.prefix_cache_hits == 3 * bs, f"engine stats count {stats.prefix_cache_hits} hit tokens"
        assert_done(sim)

    def test_engine_greedy_outputs_under_kv_pressure(
        self, conformance_checkpoint: Path, async_scheduling: bool
    ) -> None:
        """The real engine with preemption (6 blocks for 4 requests) gives ``transformers``' greedy output."""
        import pytest
        registry = get_registry()
        missing = [] if "Qwen3ForCausalLM" in registry.registrations["model"] else ["model Qwen3ForCausalLM"]
        if self.attention not in registry.registrations["attention"]:
            missing.append(f"attention backend {self.attention!r}")
        if missing:
            pytest.skip(f"the end-to-end check needs {' and '.join(missing)} installed")
        rng = random.Random(6)
        prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (20, 35, 28, 40)]
        max_tokens = 12
        bm_cls = self.get_block_manager_cls()
        with registered_for_test("scheduler", self.scheduler_cls) as scheduler, registered_for_test(
            "block_manager", bm_cls
        ) as block_manager:
            engine = ModelEngineCore(create_engine_config(
                model=str(conformance_checkpoint), device="cpu", num_kvcache_blocks=6, kvcache_block_size=16,
                max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                async_scheduling="on" if async_scheduling else "off",
                plugins={
                    "scheduler": scheduler, "block_manager": block_manager, "attention": self.attention,
                    "scheduler_options": dict(self.scheduler_options),
                    "block_manager_options": dict(self.block_manager_options),
                },
            ))
            got = run_engine(engine, prompts, max_tokens)
            assert engine.block_manager.num_free_blocks == 6, "blocks are still in use after every request finished"
        assert_matches_transformers(conformance_checkpoint, prompts, got, max_tokens)


def simulate_policy(scheduler_cls: type, **kwargs: Any) -> SimulatedEngine:
    """A :class:`SimulatedEngine` of ``scheduler_cls`` for a policy's own tests: the kit's block manager
    (``prefix_cache``), 64 blocks, 4 sequences and 64 tokens a step unless ``kwargs`` say otherwise."""
    kwargs = {"num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64, **kwargs}
    return type("Kit", (SchedulerConformance,), {"scheduler_cls": scheduler_cls})().simulate(**kwargs)
