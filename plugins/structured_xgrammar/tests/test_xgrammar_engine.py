"""The ``xgrammar`` backend in the engine: a tiny random-weight Qwen3 on CPU samples under each kind of constraint
(a GBNF grammar too, which the conformance kit checks only without the engine), and every output completes its
constraint: it satisfies it and ends with ``stop`` on the EOS token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from nanovllm_testing import write_tiny_checkpoint

from nanovllm_core import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "c": {"enum": ["x", "y"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["n", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    llm = LLM(
        str(path), device="cpu", plugins={"structured_output_backend": "xgrammar"}, kvcache_block_size=16,
        max_model_len=256, num_kvcache_blocks=64,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[a-c]{2,4}-\d", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe so"), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    else:
        assert re.fullmatch(r"a[0-9]+;", text), text


def test_every_output_satisfies_its_constraint(llm):
    constraints = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex=r"[a-c]{2,4}-\d"),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(grammar='root ::= "a" [0-9]+ ";"'),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, n=2, structured_outputs=c)
        for seed, c in enumerate(constraints)
    ]
    outputs = llm.generate([[5, 6, 7, 8]] * len(constraints), params, use_tqdm=False)
    for constraint, output in zip(constraints, outputs):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (constraint.kind, sample.text)
            assert sample.token_ids[-1] == llm.tokenizer.eos_token_id
            check(constraint.kind, sample.text)


@pytest.mark.parametrize("scheduler", ["fifo", "mixed", "priority"])
def test_constraints_hold_under_each_scheduler_with_preemption_and_cached_prefixes(tmp_path_factory, scheduler):
    """Each installed scheduler policy, async scheduling, a KV cache that preempts and prompts the prefix cache has
    seen: every sample that stopped satisfies its constraint, and every one ran its course."""
    from nanovllm_core.plugins import get_registry

    if scheduler not in get_registry().registrations["scheduler"]:
        pytest.skip(f"scheduler {scheduler!r} is not installed")
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    llm = LLM(
        str(path), device="cpu", dtype="float32", plugins={"structured_output_backend": "xgrammar",
        "scheduler": scheduler}, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=20, max_num_seqs=8,
        async_scheduling="on",
    )  # fmt: skip
    try:
        prompt = list(range(5, 5 + 40))  # three blocks shared by every request: prefix cache hits
        constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-c]{2,4}-\d")] * 3
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=150, n=2, structured_outputs=c)
                  for i, c in enumerate(constraints)]  # fmt: skip
        outputs = llm.generate([prompt + [60 + i] for i in range(len(constraints))], params, use_tqdm=False)
        stats = llm.stats()
        for constraint, output in zip(constraints, outputs):
            for sample in output.outputs:
                assert sample.finish_reason in ("stop", "length"), sample.finish_reason
                if sample.finish_reason == "stop":
                    check(constraint.kind, sample.text)
        assert sum(s.finish_reason == "stop" for o in outputs for s in o.outputs) >= 8
        assert stats.num_preemptions > 0, "the KV cache was meant to preempt"
        assert stats.prefix_cache_hit_rate > 0, "the shared prompt blocks were meant to be cached"
    finally:
        llm.shutdown()
