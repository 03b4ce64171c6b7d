"""Conformance kits: pytest base classes that check a plugin keeps the invariants of its interface.

Subclass one in your plugin's tests, name the subclass ``Test...`` and set the class attribute that names your
class; pytest collects every check::

    from nanovllm_core.testing.conformance import SchedulerConformance
    from my_package.scheduler import MyScheduler

    class TestMyScheduler(SchedulerConformance):
        scheduler_cls = MyScheduler

- :class:`SchedulerConformance` and :class:`BlockManagerConformance` drive the plugin through a
  :class:`SimulatedEngine` (a fake model and a simulated KV cache that knows which token every slot holds), so
  they run in milliseconds, then run the real :class:`~nanovllm_core.LLMEngine` on a tiny checkpoint.
- :class:`AttentionBackendConformance` compares the backend with dense float64 attention on ragged batches
  (prompt chunks over cached context next to decode tokens, MHA and GQA).
- :class:`ModelConformance` compares the engine's greedy output with ``transformers``.
- :class:`ToolParserConformance` and :class:`ReasoningParserConformance` cut replies in every way a stream can
  and compare with the whole reply's parse.

The other roles come from the installed plugins, by name (``prefix_cache``, ``fifo``, ``torch``,
``Qwen3ForCausalLM``); a class under test that is not installed is registered in-process for the run.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from nanovllm_core.engine.cuda_graph import MixedStepBuffers
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.engine.options import instantiate
from nanovllm_core.errors import InvalidRequestError, ModelLoadError
from nanovllm_core.hookspecs import PLUGIN_API_VERSION, hookimpl
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch, BlockManager, Scheduler
from nanovllm_core.loader import iter_safetensors, load_hf_config
from nanovllm_core.parsing import ReasoningParser, ToolParser
from nanovllm_core.plugins import KINDS, check_registration, get_registry, register_plugin, unregister_plugin
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.sequence import Sequence
from nanovllm_core.testing.checkpoints import hf_greedy, write_tiny_checkpoint
from nanovllm_core.testing.simulated import SimulatedEngine, random_tokens

if TYPE_CHECKING:
    import pytest

__all__ = [
    "AttentionBackendConformance",
    "BlockManagerConformance",
    "ModelConformance",
    "ReasoningParserConformance",
    "SchedulerConformance",
    "SchedulerParity",
    "SimulatedEngine",
    "ToolParserConformance",
    "registered_for_test",
    "shared_tiny_checkpoint",
]

# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


_F = TypeVar("_F", bound=Callable[..., Any])


# pytest is imported where it is used, so that the kits import where pytest is not installed (their checks run
# under pytest only); the class-level decorators below are pytest's own when it is installed.
def _fixture(**kwargs: Any) -> Callable[[_F], _F]:
    try:
        import pytest
    except ModuleNotFoundError:
        return lambda function: function
    return pytest.fixture(**kwargs)


def _parametrize(names: str, values: list[Any], ids: list[str]) -> Callable[[_F], _F]:
    try:
        import pytest
    except ModuleNotFoundError:
        return lambda function: function
    return pytest.mark.parametrize(names, values, ids=ids)


@contextmanager
def registered_for_test(kind: str, cls: type, name: str | None = None) -> Iterator[str]:
    """Yield the name under which the engine finds ``cls``, registering it in-process if it is not installed.

    For ``kind="model"`` pass the architecture as ``name``: that is the name the engine looks up.
    """
    import pytest
    registry = get_registry()
    if name is None:
        found = [r.name for r in registry.registrations[kind].values() if r.obj is cls]
        if found:
            yield found[0]
            return
        name = f"conformance-{cls.__name__}"
    existing = registry.registrations[kind].get(name)
    if existing is not None:
        if existing.obj is not cls:
            pytest.fail(
                f"{kind} {name!r} is registered by plugin {existing.plugin} ({existing.distribution}) with "
                f"{existing.obj!r}, not {cls!r}; uninstall that distribution to test this class"
            )
        yield name
        return
    plugin = types.ModuleType(f"nanovllm_conformance_{kind}_{cls.__name__}")

    def hook(register: Any) -> None:
        register(name, cls)

    setattr(plugin, KINDS[kind], hookimpl(hook))
    plugin.NANOVLLM_PLUGIN_API = str(PLUGIN_API_VERSION)
    register_plugin(plugin, name=plugin.__name__)
    try:
        registry = get_registry()
        if name not in registry.registrations[kind]:
            errors = "; ".join(b.error for b in registry.broken if b.plugin == plugin.__name__)
            pytest.fail(f"{cls!r} cannot be registered as a {kind}: {errors}")
        yield name
    finally:
        unregister_plugin(plugin.__name__)


def _installed(kind: str, name: str, setting: str) -> Any:
    """The installed registration of ``name``; skips the check (saying how to run it) when it is not installed."""
    import pytest
    registry = get_registry()
    if name not in registry.registrations[kind]:
        pytest.skip(f"this check uses the {kind} {name!r}, which is not installed: install it or set `{setting}`")
    return registry.get(kind, name)


def shared_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str = "qwen3", **options: Any) -> Path:
    """A tiny random-weight checkpoint, written once per pytest session and shared by every kit."""
    key = hashlib.sha1(repr(sorted(options.items())).encode()).hexdigest()[:10]
    path = tmp_path_factory.getbasetemp() / "nanovllm-conformance" / f"{arch}-{key}"
    if not path.is_dir():
        partial = path.with_name(f"{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_tiny_checkpoint(partial, arch, **options)
        partial.rename(path)  # only a complete checkpoint gets the shared name
    return path


def _run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, max_steps: int = 10_000
) -> list[list[int]]:
    import pytest
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"conformance-{i}") for i, p in enumerate(prompts)]
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    else:
        pytest.fail(f"the engine did not finish {len(prompts)} requests within {max_steps} steps")
    missing = [i for i in ids if i not in outputs]
    assert not missing, f"requests {missing} never came back from LLMEngine.step()"
    return [outputs[i] for i in ids]


def _first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first difference at output token {i}: got {a}, expected {b}"
    return f"lengths differ: got {len(got)} tokens, expected {len(want)}"


# ----------------------------------------------------------------------------------------------------
# Scheduler
# ----------------------------------------------------------------------------------------------------


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

    @_fixture(params=[False, True], ids=["sync", "async"])
    def async_scheduling(self, request: pytest.FixtureRequest) -> bool:
        return request.param

    def get_block_manager_cls(self) -> type[BlockManager]:
        if self.block_manager_cls is not None:
            return self.block_manager_cls
        return _installed("block_manager", self.block_manager_name, "block_manager_cls").obj

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

    @_fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return shared_tiny_checkpoint(tmp_path_factory)

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
        assert len(sim.finished) == 12, f"{len(sim.finished)} of 12 requests finished"
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
        assert len(sim.finished) == 7, f"{len(sim.finished)} of 7 requests finished"
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

    def test_request_that_can_never_fit_is_rejected(self) -> None:
        import pytest
        sim = self.simulate(num_blocks=4)
        rng = random.Random(1)
        with pytest.raises(InvalidRequestError):
            sim.add(random_tokens(5 * self.block_size, rng), 4)
        assert not sim.scheduler.has_unfinished(), "a rejected request must leave the scheduler unchanged"
        sim.add(random_tokens(20, rng), 4)
        sim.run()
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()
        assert sim.abort(sim.finished[0].request_id) is None, "abort of a finished request must return None"

    def test_preemption_under_kv_pressure_keeps_outputs(self, async_scheduling: bool) -> None:
        """The cache holds the largest request but not all of them: every output is still exact."""
        sim = self.simulate(num_blocks=6, async_scheduling=async_scheduling, max_num_seqs=8, max_num_batched_tokens=64)
        rng = random.Random(4)
        for n in (30, 25, 40, 18, 33, 27):
            sim.add(random_tokens(n, rng), 40)
        sim.run()
        assert len(sim.finished) == 6, f"{len(sim.finished)} of 6 requests finished"
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
        assert len(sim.finished) == 2, f"{len(sim.finished)} of 2 requests finished"
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
            sim.assert_outputs_exact()
            sim.assert_all_blocks_free()

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
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()

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
            engine = LLMEngine(
                model=str(conformance_checkpoint), device="cpu", num_kvcache_blocks=6, kvcache_block_size=16,
                max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                async_scheduling="on" if async_scheduling else "off",
                plugins={
                    "scheduler": scheduler, "block_manager": block_manager, "attention": self.attention,
                    "scheduler_options": dict(self.scheduler_options),
                    "block_manager_options": dict(self.block_manager_options),
                },
            )
            got = _run_engine(engine, prompts, max_tokens)
            assert engine.block_manager.num_free_blocks == 6, "blocks are still in use after every request finished"
        want = hf_greedy(conformance_checkpoint, prompts, max_tokens)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"prompt {i} ({len(prompts[i])} tokens): " + _first_difference(g, w)


class SchedulerParity:
    """Greedy output under the installed scheduler ``scheduler_name`` equals ``reference_name``'s (``fifo``), token
    for token, on the real engine (tiny Qwen3 checkpoint, CPU, ``torch`` attention) in every scheduling regime:
    plain, chunked prefill, preemption, both, prefix-cache hits and requests of mixed priorities, each with and
    without async scheduling. A policy may reorder work; it must never change what greedy decoding produces.

    Set ``scheduler_name`` in a ``Test...`` subclass; ``extra_regimes`` adds ``name: (engine settings, policy
    options)`` cases, ``priority_options`` lists the policy options the mixed-priority check runs with, and
    :meth:`check_engine_after` adds the policy's own checks on the engine after each run. Skipped, saying why,
    when the model plugin, the attention backend or either scheduler is not installed.
    """

    scheduler_name: ClassVar[str]
    reference_name: ClassVar[str] = "fifo"
    extra_regimes: ClassVar[dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {}
    priority_options: ClassVar[list[dict[str, Any]]] = [{}]
    max_new_tokens: ClassVar[int] = 16
    prompt_lengths: ClassVar[tuple[int, ...]] = (5, 17, 40, 73, 120)
    # "preempted" regimes give too few KV blocks (16 tokens each) for all prompts at once
    regimes: ClassVar[dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
        "plain": ({"num_kvcache_blocks": 128}, {}),
        "chunked": ({"num_kvcache_blocks": 128, "max_num_batched_tokens": 48, "max_num_seqs": 8}, {}),
        "preempted": ({"num_kvcache_blocks": 11}, {}),
        "preempted-chunked": ({"num_kvcache_blocks": 11, "max_num_batched_tokens": 40, "max_num_seqs": 8}, {}),
    }

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "regime" in metafunc.fixturenames:
            metafunc.parametrize("regime", [*self.regimes, *self.extra_regimes])
        if "policy_options" in metafunc.fixturenames:
            metafunc.parametrize("policy_options", self.priority_options, ids=str)
        if "async_scheduling" in metafunc.fixturenames:
            metafunc.parametrize("async_scheduling", [False, True], ids=["sync", "async"])

    @property
    def prompts(self) -> list[list[int]]:
        rng = random.Random(0)
        return [[rng.randrange(3, 380) for _ in range(n)] for n in self.prompt_lengths]

    def greedy(self, **kwargs: Any) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.max_new_tokens, ignore_eos=True, **kwargs)

    def engine(self, path: Path, scheduler: str, async_scheduling: bool = False, options: dict | None = None,
               **settings: Any) -> LLMEngine:
        from nanovllm_core.entrypoints.llm import LLM

        for kind, name in (("scheduler", scheduler), ("attention", "torch"), ("model", "Qwen3ForCausalLM")):
            _installed(kind, name, "scheduler_name" if kind == "scheduler" else kind)
        plugins = {"scheduler": scheduler, "scheduler_options": dict(options or {}), "attention": "torch"}
        return LLM(
            str(path), kvcache_block_size=16, max_model_len=512, async_scheduling="on" if async_scheduling else "off",
            plugins=plugins, **settings,
        )

    def generate(self, llm: Any, prompts: list[list[int]], params: Any = None) -> list[list[int]]:
        outs = llm.generate(prompts, params or self.greedy(), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def check_engine_after(self, llm: LLMEngine) -> None:
        """After every run: every block free (subclasses add the policy's own checks)."""
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks left in use"

    @_fixture(scope="class")
    @classmethod
    def parity_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return shared_tiny_checkpoint(tmp_path_factory)

    @_fixture(scope="class")
    @classmethod
    def reference_tokens(cls, parity_checkpoint: Path) -> dict[str, list[list[int]]]:
        kit = cls()
        return {
            name: kit.generate(kit.engine(parity_checkpoint, cls.reference_name, **settings), kit.prompts)
            for name, (settings, _) in {**cls.regimes, **cls.extra_regimes}.items()
        }

    def test_greedy_matches_the_reference(
        self, parity_checkpoint: Path, reference_tokens: dict, regime: str, async_scheduling: bool
    ) -> None:
        settings, options = {**self.regimes, **self.extra_regimes}[regime]
        llm = self.engine(parity_checkpoint, self.scheduler_name, async_scheduling, options, **settings)
        assert self.generate(llm, self.prompts) == reference_tokens[regime]
        if settings["num_kvcache_blocks"] < 16:
            assert llm.scheduler.num_preemptions > 0, f"regime {regime!r} was meant to preempt"
        self.check_engine_after(llm)

    def test_prefix_cache_hits_match_the_reference(self, parity_checkpoint: Path, async_scheduling: bool) -> None:
        prompts = self.prompts
        shared = prompts[3][:50]
        family = [shared + tail for tail in ([7, 8, 9], prompts[1], prompts[2][:20])]
        results = []
        for llm in (self.engine(parity_checkpoint, self.reference_name, num_kvcache_blocks=128),
                    self.engine(parity_checkpoint, self.scheduler_name, async_scheduling, num_kvcache_blocks=128)):
            first = llm.generate(family[:1], self.greedy(), use_tqdm=False)
            rest = llm.generate(family[1:], self.greedy(), use_tqdm=False)
            results.append(([o.outputs[0].token_ids for o in first + rest], [o.num_cached_tokens for o in rest]))
        assert results[1] == results[0]
        assert results[1][1] == [48, 48], "50 shared tokens: 3 full blocks of 16 are in the cache"

    def test_mixed_priorities_match_the_reference(
        self, parity_checkpoint: Path, reference_tokens: dict, policy_options: dict, async_scheduling: bool
    ) -> None:
        """Requests of different priorities, chunked and preempted: the order may change, the tokens do not."""
        params = [self.greedy(priority=p) for p in (2, 0, 1, 0, 2)]
        settings, _ = self.regimes["preempted-chunked"]
        llm = self.engine(parity_checkpoint, self.scheduler_name, async_scheduling, policy_options, **settings)
        assert self.generate(llm, self.prompts, params) == reference_tokens["preempted-chunked"]
        assert llm.scheduler.num_preemptions > 0
        self.check_engine_after(llm)


# ----------------------------------------------------------------------------------------------------
# Block manager
# ----------------------------------------------------------------------------------------------------


class BlockManagerConformance:
    """Checks a :class:`~nanovllm_core.BlockManager`; set ``block_manager_cls`` in a ``Test...`` subclass.

    Set ``supports_prefix_caching = False`` for a manager that never finds cached blocks. The scheduler for
    the end-to-end check is the installed ``scheduler_name`` (``fifo``) unless ``scheduler_cls`` is set.
    """

    block_manager_cls: ClassVar[type[BlockManager]]
    block_manager_options: ClassVar[dict[str, Any]] = {}
    supports_prefix_caching: ClassVar[bool] = True
    scheduler_cls: ClassVar[type[Scheduler] | None] = None
    scheduler_name: ClassVar[str] = "fifo"
    block_size: ClassVar[int] = 16

    def make(self, num_blocks: int, enable_prefix_caching: bool = True) -> BlockManager:
        return instantiate(
            "block_manager", self.block_manager_cls, dict(self.block_manager_options), num_blocks, self.block_size,
            enable_prefix_caching=enable_prefix_caching,
        )

    @staticmethod
    def seq(tokens: list[int]) -> Sequence:
        return Sequence(tokens, SamplingParams(max_tokens=64))

    @staticmethod
    def compute(bm: BlockManager, seq: Sequence) -> None:
        """What a step does once the KV of every token of ``seq`` is written: advance and cache."""
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)

    def test_is_a_block_manager(self) -> None:
        problem = check_registration("block_manager", self.block_manager_cls)
        assert problem is None, problem

    def test_starts_with_every_block_free(self) -> None:
        bm = self.make(8)
        got = (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_used_blocks)
        assert got == (8, self.block_size, 8, 0), f"(num_blocks, block_size, free, used) of a new manager: {got}"

    def test_allocate_covers_the_tokens_and_free_returns_every_block(self) -> None:
        bm, bs = self.make(8), self.block_size
        seq = self.seq(list(range(2 * bs + 3)))
        assert bm.allocate(seq, seq.num_uncomputed_tokens), "allocate failed with every block free"
        table = list(seq.block_table)
        assert len(table) == 3 and len(set(table)) == 3 and all(0 <= b < 8 for b in table), (
            f"{2 * bs + 3} tokens need 3 distinct blocks in [0, 8); got {table}"
        )
        assert bm.num_free_blocks == 5, f"3 of 8 blocks in use but num_free_blocks is {bm.num_free_blocks}"
        bm.free(seq)
        assert seq.block_table == [], "free must clear the block table"
        assert bm.num_free_blocks == 8, f"after free, {bm.num_free_blocks} of 8 blocks are free"
        bm.free(seq)
        assert bm.num_free_blocks == 8, "free must be idempotent"

    def test_allocate_is_all_or_nothing(self) -> None:
        bm, bs = self.make(4), self.block_size
        a = self.seq(list(range(3 * bs)))
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(list(range(1000, 1000 + 2 * bs)))
        assert not bm.allocate(b, b.num_uncomputed_tokens), "allocated 2 blocks with 1 free"
        state = (b.block_table, b.num_computed_tokens, bm.num_free_blocks)
        assert state == ([], 0, 1), "a failed allocate changed state"
        before = list(a.block_table)
        assert not bm.allocate(a, bs + 1), "grew a sequence by 2 blocks with 1 free"
        assert a.block_table == before and bm.num_free_blocks == 1, "a failed allocate changed state"
        bm.free(a)
        assert bm.num_free_blocks == 4, f"after free, {bm.num_free_blocks} of 4 blocks are free"

    def test_decode_appends_a_block_only_at_a_boundary(self) -> None:
        bm, bs = self.make(4), self.block_size
        seq = self.seq(list(range(bs)))
        assert bm.allocate(seq, seq.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, seq)
        assert len(seq.block_table) == 1, f"{bs} tokens need one block, got {seq.block_table}"
        seq.append_token(7)
        assert bm.allocate(seq, 1) and len(seq.block_table) == 2, "token bs+1 needs a second block"
        self.compute(bm, seq)
        seq.append_token(8)
        assert bm.allocate(seq, 1) and len(seq.block_table) == 2, "token bs+2 fits the second block"
        bm.free(seq)
        assert bm.num_free_blocks == 4, f"after free, {bm.num_free_blocks} of 4 blocks are free"

    def test_prefix_cache_hit_is_the_shared_full_block_prefix(self) -> None:
        import pytest
        if not self.supports_prefix_caching:
            pytest.skip("supports_prefix_caching = False")
        bm, bs = self.make(16), self.block_size
        shared = list(range(100, 100 + 2 * bs))
        a = self.seq(shared + [1, 2, 3, 4, 5])
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(shared + [9, 9, 9, 9, 9, 9, 9])
        free_before = bm.num_free_blocks
        assert bm.num_cached_tokens(b) == 2 * bs, "the 2 shared full blocks are not found"
        assert bm.num_free_blocks == free_before and b.block_table == [], "num_cached_tokens must have no side effects"
        assert bm.num_cached_tokens(self.seq(shared[:bs] + [7] * bs + [1])) == bs, "only the first block is shared"
        assert bm.num_cached_tokens(self.seq(list(shared))) == bs, (
            "a prompt of exactly 2 cached blocks may reuse only 1: the last token is always computed"
        )
        assert bm.num_cached_tokens(self.seq([5] + shared)) == 0, "a shifted prefix must not hit"
        assert bm.allocate(b, b.num_uncomputed_tokens), "allocate failed with enough free blocks"
        assert b.num_computed_tokens == 2 * bs, "allocate must advance num_computed_tokens past the cached prefix"
        assert b.block_table[:2] == a.block_table[:2], "the cached prefix must be a's blocks"
        assert bm.num_used_blocks == len(set(a.block_table) | set(b.block_table)), "shared blocks counted twice"
        bm.free(a)
        assert bm.num_used_blocks == len(b.block_table), "blocks b shares with a must stay in use after free(a)"
        bm.free(b)
        assert bm.num_free_blocks == 16, f"after freeing both, {bm.num_free_blocks} of 16 blocks are free"

    def test_prefix_caching_disabled_finds_nothing(self) -> None:
        bm, bs = self.make(16, enable_prefix_caching=False), self.block_size
        shared = list(range(100, 100 + 2 * bs))
        a = self.seq(shared + [1])
        assert bm.allocate(a, a.num_uncomputed_tokens), "allocate failed with every block free"
        self.compute(bm, a)
        b = self.seq(shared + [2])
        assert bm.num_cached_tokens(b) == 0, "found cached tokens with enable_prefix_caching=False"
        assert bm.allocate(b, b.num_uncomputed_tokens), "allocate failed with enough free blocks"
        assert b.num_computed_tokens == 0, "claimed cached tokens with enable_prefix_caching=False"
        assert not set(a.block_table) & set(b.block_table), "blocks shared with prefix caching disabled"
        bm.free(a)
        bm.free(b)
        assert bm.num_free_blocks == 16, f"after freeing both, {bm.num_free_blocks} of 16 blocks are free"

    def test_under_a_scheduler_with_shared_prefixes_and_kv_pressure(self) -> None:
        """The installed scheduler drives the manager; cached blocks must hold exactly their tokens."""
        scheduler_cls = self.scheduler_cls or _installed("scheduler", self.scheduler_name, "scheduler_cls").obj
        sim = SimulatedEngine(
            scheduler_cls, self.block_manager_cls, num_blocks=10, block_size=self.block_size,
            block_manager_options=self.block_manager_options, max_num_seqs=4, max_num_batched_tokens=48,
        )
        rng = random.Random(7)
        families = [random_tokens(self.block_size * k, rng) for k in (1, 2, 3)]
        for wave in range(3):
            for i in range(4):
                sim.add(families[(wave + i) % 3] + random_tokens(rng.randint(1, 20), rng), rng.randint(4, 24))
            for _ in range(6):
                if sim.core.has_unfinished_requests():
                    sim.step()
        sim.run()
        assert len(sim.finished) == 12, f"{len(sim.finished)} of 12 requests finished"
        sim.assert_outputs_exact()
        sim.assert_all_blocks_free()


# ----------------------------------------------------------------------------------------------------
# Attention backend
# ----------------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention in float64 of queries at positions ``start...`` over keys/values ``[0, end)``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class AttentionBackendConformance:
    """Checks an :class:`~nanovllm_core.AttentionBackend`; set ``backend_cls`` in a ``Test...`` subclass.

    Three steps over six sequences of a paged cache with shuffled blocks and two layers: prompts only, then
    prompt chunks over cached context beside decode tokens and a new prompt, then decode only. Every output
    is compared with :func:`dense_attention`; a backend with ``supports_cuda_graph_mixed`` runs the steps with
    prompt tokens a second time through a CUDA graph's padded static batch. Skipped where ``check_available``
    says the backend cannot run.
    """

    backend_cls: ClassVar[type[AttentionBackend]]
    backend_options: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[torch.dtype] = torch.float32
    head_dim: ClassVar[int] = 128
    block_size: ClassVar[int | None] = None  # None: the first supported size, or 16
    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4

    def _setup(self) -> tuple[torch.device, int]:
        import pytest
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        device = torch.device(self.device)
        reason = self.backend_cls.check_available(device, self.dtype, self.head_dim)
        if reason is not None:
            pytest.skip(f"{self.backend_cls.__name__} is not available here: {reason}")
        sizes = self.backend_cls.supported_block_sizes()
        return device, self.block_size or (sizes[0] if sizes else 16)

    def test_is_an_attention_backend(self) -> None:
        problem = check_registration("attention", self.backend_cls)
        assert problem is None, problem
        assert isinstance(self.backend_cls.name, str) and self.backend_cls.name, "set the class attribute `name`"

    def test_supported_block_sizes_are_valid(self) -> None:
        sizes = self.backend_cls.supported_block_sizes()
        if sizes is not None:
            assert sizes and all(16 <= s <= 256 and s & (s - 1) == 0 for s in sizes), (
                f"supported_block_sizes() = {sizes}: the config allows powers of two from 16 to 256"
            )

    @_parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    def test_ragged_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        self._check_ragged_batches(num_heads, num_kv_heads, graph_buffers=False)

    @_parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    def test_graph_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        """Backends with ``supports_cuda_graph_mixed``: the steps with prompt tokens go through the static batch
        a captured graph replays (``MixedStepBuffers``: padding rows, tokens owned by no sequence holding NaN,
        metadata from ``build_graph_metadata``), as the model runner's graphs do."""
        import pytest
        if not self.backend_cls.supports_cuda_graph_mixed:
            pytest.skip(f"{self.backend_cls.__name__} does not capture steps with prompt tokens")
        self._check_ragged_batches(num_heads, num_kv_heads, graph_buffers=True)

    def _check_ragged_batches(self, num_heads: int, num_kv_heads: int, graph_buffers: bool) -> None:
        device, bs = self._setup()
        d, dtype, num_layers = self.head_dim, self.dtype, 2
        # Positions that each sequence has computed after steps 0, 1, 2, 3.
        plans = [
            (0, bs + 4, bs + 5, bs + 6),  # prompt, then decode tokens
            (0, 5, 12, 13),  # short prompt, chunk in the same block, decode
            (0, 2 * bs + 1, 2 * bs + 2, 2 * bs + 3),  # prompt over three blocks, decodes
            (0, bs, 2 * bs + 4, 2 * bs + 5),  # chunk ending on a block boundary, chunk across blocks
            (0, 0, 3, 4),  # arrives in the second step
            (0, 1, 2, 3),  # one-token prompt
        ]
        gen = torch.Generator().manual_seed(0)
        lengths = [plan[-1] for plan in plans]
        num_blocks = sum(-(-n // bs) for n in lengths) + 3
        free = torch.randperm(num_blocks, generator=gen).tolist()
        tables = []
        for n in lengths:
            tables.append(free[: -(-n // bs)])
            free = free[-(-n // bs) :]

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)  # rounded to dtype once: the reference sees the same

        q = [[rand(n, num_heads, d) for n in lengths] for _ in range(num_layers)]
        k = [[rand(n, num_kv_heads, d) for n in lengths] for _ in range(num_layers)]
        v = [[rand(n, num_kv_heads, d) for n in lengths] for _ in range(num_layers)]
        shape = self.backend_cls.kv_cache_shape(num_blocks, bs, num_kv_heads, d)
        caches = [(torch.randn(*shape, generator=gen) * 3).to(device=device, dtype=dtype) for _ in range(num_layers)]
        scale = d**-0.5
        backend = self.backend_cls(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=d, scale=scale, block_size=bs, dtype=dtype,
            device=device, **self.backend_options,
        )
        step_tokens = [sum(plan[step + 1] - plan[step] for plan in plans) for step in range(3)]
        buffers = MixedStepBuffers(len(plans) + 2, max(step_tokens) + 5, max(lengths) + bs, bs, device)
        for step in range(3):
            rows = [(i, plan[step], plan[step + 1]) for i, plan in enumerate(plans) if plan[step + 1] > plan[step]]
            batch = AttentionBatch.from_spans([tables[i] for i, _, _ in rows], [(s, e) for _, s, e in rows], bs, device)
            padded = graph_buffers and buffers.can_run(batch)
            if padded:
                no_ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)
                size = buffers.load(no_ids, no_ids, batch)
                metadata = backend.build_graph_metadata(buffers.bucket(size))
            else:
                metadata = backend.build_metadata(batch)
            for layer in range(num_layers):
                qs, ks, vs = ([x[layer][i][s:e] for i, s, e in rows] for x in (q, k, v))
                qkv = [torch.cat(x).to(device) for x in (qs, ks, vs)]
                if padded:  # the bucket's tokens past the step's: owned by no sequence, never stored or read
                    qkv = [torch.cat([x, x.new_full((size - len(x), *x.shape[1:]), torch.nan)]) for x in qkv]
                out = backend.forward(*qkv, caches[layer], metadata)
                if padded:
                    out = out[: batch.num_tokens]
                assert out.shape == (batch.num_tokens, num_heads, d), f"output shape {tuple(out.shape)}"
                offset = 0
                for i, s, e in rows:
                    ref = dense_attention(q[layer][i][s:e], k[layer][i][:e], v[layer][i][:e], s, scale)
                    got = out[offset : offset + e - s].double().cpu()
                    offset += e - s
                    torch.testing.assert_close(
                        got, ref, atol=self.atol, rtol=self.rtol,
                        msg=lambda m, i=i, s=s, e=e, step=step, layer=layer: (
                            f"step {step}, layer {layer}, sequence {i}: queries at positions [{s}, {e}) over "
                            f"{e} tokens of context ({s} cached): {m}"
                        ),
                    )


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------


class ModelConformance:
    """Checks a model class; set ``model_cls`` (and ``checkpoint_arch``) in a ``Test...`` subclass.

    The checkpoint is a tiny random-weight one from :func:`~nanovllm_core.testing.write_tiny_checkpoint`
    (``checkpoint_arch``, ``checkpoint_options``); override :meth:`write_checkpoint` for other architectures.
    """

    model_cls: ClassVar[type[torch.nn.Module]]
    architecture: ClassVar[str | None] = None  # default: model_cls.__name__
    checkpoint_arch: ClassVar[str] = "qwen3"
    checkpoint_options: ClassVar[dict[str, Any]] = {}
    attention: ClassVar[str] = "torch"
    max_new_tokens: ClassVar[int] = 8

    def write_checkpoint(self, path: Path) -> Path:
        """Write a tiny checkpoint of this architecture (``config.json``, safetensors, tokenizer) into ``path``."""
        return write_tiny_checkpoint(path, self.checkpoint_arch, **self.checkpoint_options)

    @_fixture(scope="class")
    @classmethod
    def model_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        if cls.write_checkpoint is ModelConformance.write_checkpoint:
            return shared_tiny_checkpoint(tmp_path_factory, cls.checkpoint_arch, **cls.checkpoint_options)
        return cls().write_checkpoint(tmp_path_factory.mktemp(f"conformance-{cls.model_cls.__name__}"))

    def get_architecture(self) -> str:
        return self.architecture or self.model_cls.__name__

    def test_implements_the_causal_lm_protocol(self) -> None:
        problem = check_registration("model", self.model_cls)
        assert problem is None, problem

    def test_checkpoint_names_the_architecture(self, model_checkpoint: Path) -> None:
        names = json.loads((model_checkpoint / "config.json").read_text()).get("architectures") or []
        assert names[:1] == [self.get_architecture()], (
            f"config.json names architectures {names}; the engine looks up architectures[0], so register the "
            f"class as {names[:1] or '?'} or set `architecture`"
        )

    def test_load_weights_rejects_an_incomplete_checkpoint(self, model_checkpoint: Path) -> None:
        import pytest
        hf_config = load_hf_config(model_checkpoint)
        weights = list(iter_safetensors(model_checkpoint))
        dropped = next((name for name, _ in weights if "layers." in name), weights[-1][0])
        model = self.model_cls(hf_config)
        with pytest.raises(ModelLoadError):
            model.load_weights([(n, t) for n, t in weights if n != dropped])
        model.load_weights(weights)

    def test_greedy_matches_transformers(self, model_checkpoint: Path) -> None:
        """Ragged prompts, chunked prefill (32-token budget) and a prefix-cache hit, against ``transformers``."""
        _installed("attention", self.attention, "attention")
        vocab = load_hf_config(model_checkpoint).vocab_size
        rng = random.Random(8)
        first = [rng.randrange(3, vocab) for _ in range(37)]
        prompts = [first, [rng.randrange(3, vocab) for _ in range(3)], [rng.randrange(3, vocab) for _ in range(70)],
                   first[:32] + [rng.randrange(3, vocab) for _ in range(3)]]
        with registered_for_test("model", self.model_cls, name=self.get_architecture()):
            engine = LLMEngine(
                model=str(model_checkpoint), device="cpu", dtype="float32", num_kvcache_blocks=64,
                kvcache_block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
                plugins={"attention": self.attention},
            )
            got = _run_engine(engine, prompts, self.max_new_tokens)
        want = hf_greedy(model_checkpoint, prompts, self.max_new_tokens)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"prompt {i} ({len(prompts[i])} tokens): " + _first_difference(g, w)


# ----------------------------------------------------------------------------------------------------
# Reply parsers
# ----------------------------------------------------------------------------------------------------


def _cuts(text: str) -> Iterator[list[str]]:
    """``text`` in one piece, a character a piece, and cut at every pair of places (a stream can cut anywhere)."""
    yield [text]
    yield list(text) or [""]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


class ToolParserConformance:
    """A tool parser (``nanovllm_register_tool_parsers``): on each of ``replies`` (texts in its format, with and
    without calls) its stream, cut anywhere, gives the content and the calls of ``parse``; the calls' arguments
    are JSON objects; a reply with no calls in it comes back as content, unchanged."""

    parser_cls: ClassVar[type[ToolParser]]
    replies: ClassVar[list[str]]
    plain_replies: ClassVar[list[str]] = ["Just an answer.", "", "a < b and c > d", "<tool <function x"]

    def test_is_a_tool_parser(self) -> None:
        assert check_registration("tool_parser", self.parser_cls) is None, check_registration(
            "tool_parser", self.parser_cls
        )

    def test_replies_have_calls_with_json_object_arguments(self) -> None:
        for reply in self.replies:
            parsed = self.parser_cls().parse(reply)
            assert parsed.tool_calls, f"no call found in {reply!r}: make `replies` texts with calls"
            for call in parsed.tool_calls:
                assert call.name and isinstance(json.loads(call.arguments), dict), (reply, call)
        for reply in self.plain_replies:
            parsed = self.parser_cls().parse(reply)
            assert (parsed.content, parsed.tool_calls) == (reply, []), reply

    def test_a_stream_cut_anywhere_gives_what_parse_gives(self) -> None:
        for reply in self.replies + self.plain_replies:
            whole = self.parser_cls().parse(reply)
            for pieces in _cuts(reply):
                stream = self.parser_cls().new_stream()
                content, calls = "", []
                for piece in pieces:
                    more_content, more_calls = stream.feed(piece)
                    content, calls = content + more_content, calls + more_calls
                rest, last = stream.finish()
                content, calls = content + rest, calls + last
                assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
                assert content == (whole.content or "") or (whole.content is None and not content.strip()), (
                    f"{pieces!r}: content {content!r}, parse gives {whole.content!r}"
                )
                assert stream.num_calls == len(calls)


class ReasoningParserConformance:
    """A reasoning parser (``nanovllm_register_reasoning_parsers``): on each of ``replies`` its stream, cut
    anywhere, gives the thinking and the answer of ``parse``, and ``parse`` gives ``expected`` (one
    ``(thinking or None, answer)`` per reply)."""

    parser_cls: ClassVar[type[ReasoningParser]]
    replies: ClassVar[list[str]]
    expected: ClassVar[list[tuple[str | None, str]]]

    def test_is_a_reasoning_parser(self) -> None:
        assert check_registration("reasoning_parser", self.parser_cls) is None, check_registration(
            "reasoning_parser", self.parser_cls
        )

    def test_parse_splits_as_expected(self) -> None:
        assert [self.parser_cls().parse(reply) for reply in self.replies] == self.expected

    def test_a_stream_cut_anywhere_gives_what_parse_gives(self) -> None:
        for reply in self.replies:
            thinking, answer = self.parser_cls().parse(reply)
            for pieces in _cuts(reply):
                stream = self.parser_cls().new_stream()
                got_thinking = got_answer = ""
                for piece in pieces:
                    more_thinking, more_answer = stream.feed(piece)
                    got_thinking, got_answer = got_thinking + more_thinking, got_answer + more_answer
                rest_thinking, rest_answer = stream.finish()
                got = (got_thinking + rest_thinking, got_answer + rest_answer)
                assert got == (thinking or "", answer), f"{pieces!r}: {got!r}, parse gives {(thinking, answer)!r}"
                assert stream.reasoned == (thinking is not None)
