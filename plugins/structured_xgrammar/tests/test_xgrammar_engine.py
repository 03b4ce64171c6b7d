"""The ``xgrammar`` backend in the engine: a tiny random-weight Qwen3 on CPU samples under each kind of constraint
(a GBNF grammar too, which the conformance kit checks only without the engine), and every output completes its
constraint: it satisfies it and ends with ``stop`` on the EOS token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanovllm_core import LLM, SamplingParams, StructuredOutputsParams
from nanovllm_core.testing import write_tiny_checkpoint

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
