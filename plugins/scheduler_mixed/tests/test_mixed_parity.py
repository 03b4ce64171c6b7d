"""Greedy output under ``mixed`` equals ``fifo``'s, token for token: the real engine on a tiny Qwen3 checkpoint
(CPU), in every scheduling regime, with and without async scheduling."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.testing.conformance import shared_tiny_checkpoint

SCHEDULER = "mixed"
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(n)] for n in (5, 17, 40, 73, 120)]
# name: (engine settings, this policy's options); "preempted" regimes have too few KV blocks for all prompts
REGIMES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({"num_kvcache_blocks": 128}, {}),
    "chunked": ({"num_kvcache_blocks": 128, "max_num_batched_tokens": 48, "max_num_seqs": 8}, {}),
    "chunk-cap": ({"num_kvcache_blocks": 128}, {"long_prefill_token_threshold": 16}),
    "preempted": ({"num_kvcache_blocks": 11}, {}),
    "preempted-chunked": ({"num_kvcache_blocks": 11, "max_num_batched_tokens": 40, "max_num_seqs": 8}, {}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


def engine(path: Path, scheduler: str, async_scheduling: bool = False, options: dict | None = None, **kw: Any) -> LLM:
    plugins = {"scheduler": scheduler, "scheduler_options": dict(options or {})}
    return LLM(
        str(path), kvcache_block_size=16, max_model_len=512, async_scheduling="on" if async_scheduling else "off",
        plugins=plugins, **kw,
    )


def generate(llm: LLM, prompts: list[list[int]], params: Any = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def fifo_tokens(checkpoint: Path) -> dict[str, list[list[int]]]:
    return {name: generate(engine(checkpoint, "fifo", **settings), PROMPTS) for name, (settings, _) in REGIMES.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_fifo(checkpoint: Path, fifo_tokens: dict, regime: str, async_scheduling: bool) -> None:
    settings, options = REGIMES[regime]
    llm = engine(checkpoint, SCHEDULER, async_scheduling, options, **settings)
    assert generate(llm, PROMPTS) == fifo_tokens[regime]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    if regime.startswith("preempted"):
        assert llm.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_cache_hits_match_fifo(checkpoint: Path, async_scheduling: bool) -> None:
    shared = PROMPTS[3][:50]
    prompts = [shared + tail for tail in ([7, 8, 9], PROMPTS[1], PROMPTS[2][:20])]
    results = []
    for llm in (engine(checkpoint, "fifo", num_kvcache_blocks=128),
                engine(checkpoint, SCHEDULER, async_scheduling, num_kvcache_blocks=128)):
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in first + rest], [o.num_cached_tokens for o in rest]))
    assert results[1] == results[0]
    assert results[1][1] == [48, 48]  # 50 shared tokens: 3 full blocks of 16 found in the cache


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_priorities_mixed_match_fifo(checkpoint: Path, fifo_tokens: dict, async_scheduling: bool) -> None:
    """Requests of different priorities, chunked and preempted: the order changes, the tokens do not."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, priority=p) for p in (2, 0, 1, 0, 2)]
    settings, _ = REGIMES["preempted-chunked"]
    llm = engine(checkpoint, SCHEDULER, async_scheduling, **settings)
    assert generate(llm, PROMPTS, params) == fifo_tokens["preempted-chunked"]
    assert llm.scheduler.num_preemptions > 0
