"""The scheduler parity kit: :class:`SchedulerParity`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_testing.conformance._shared import fixture, installed_plugin, shared_checkpoint_fixture

if TYPE_CHECKING:
    import pytest


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
               **settings: Any) -> ModelEngineCore:
        from nanovllm_core.entrypoints.llm import LLM

        for kind, name in (("scheduler", scheduler), ("attention", "torch"), ("model", "Qwen3ForCausalLM")):
            installed_plugin(kind, name, "scheduler_name" if kind == "scheduler" else kind)
        plugins = {"scheduler": scheduler, "scheduler_options": dict(options or {}), "attention": "torch"}
        return LLM(
            str(path), kvcache_block_size=16, max_model_len=512, async_scheduling="on" if async_scheduling else "off",
            plugins=plugins, **settings,
        )

    def generate(self, llm: Any, prompts: list[list[int]], params: Any = None) -> list[list[int]]:
        outs = llm.generate(prompts, params or self.greedy(), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def check_engine_after(self, llm: ModelEngineCore) -> None:
        """After every run: every block free (subclasses add the policy's own checks)."""
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks left in use"

    parity_checkpoint = shared_checkpoint_fixture()

    @fixture(scope="class")
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
