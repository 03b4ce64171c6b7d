"""The structured-output kit: a backend's constraints hold, token by token and through the engine.

A random-weight model is the strongest test a grammar engine can get: its logits favour nothing, so every output
is a random walk through what the mask allows, and it must still parse and validate. The kit checks, on the
tiny checkpoint's tokenizer:

- ``validate`` refuses broken schemas, regexes and grammars with a one-line ``ValueError``;
- random walks through the backend's bitmasks (without a model) end in text that satisfies the constraint,
  and a rollback restores the bitmask;
- through the real engine (torch attention, the installed ``fifo`` and ``prefix_cache``), greedy and sampled
  outputs, ``n > 1`` and a small KV cache that preempts, every output that stopped satisfies its constraint, an
  invalid constraint is refused when it is added, and free requests in the same batch get the tokens they get
  alone.

Set ``backend_cls``; override ``invalid_grammar``/``valid_grammar`` for a backend whose grammar syntax is not
GBNF/EBNF-like (``root ::= ...``) and ``grammar_text`` to check what ``valid_grammar`` produces.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, ClassVar

from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm_core.structured_output import StructuredOutputBackend, bitmask_words
from nanovllm_testing.conformance._shared import (
    fixture,
    parametrize,
    registered_for_test,
    shared_checkpoint_fixture,
)

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "alan", "grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["paris", "rome"]}, "zip": {"type": "integer", "maximum": 99}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}"
CHOICES = ["positive", "negative", 'a "quoted" one']
CONSTRAINTS: dict[str, StructuredOutputsParams] = {
    "json": StructuredOutputsParams(json=PERSON_SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "json_object": StructuredOutputsParams(json_object=True),
}
WALK_STEPS = 300  # tokens a walk may take before it counts as not terminated


def satisfies(kind: str, text: str) -> bool:
    """Whether ``text`` satisfies the kit's constraint of ``kind``."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    import jsonschema

    try:
        jsonschema.validate(value, PERSON_SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def allowed_tokens(bitmask: Any, index: int, vocab_size: int) -> list[int]:
    words = bitmask[index].tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def random_walk(backend: StructuredOutputBackend, compiled: Any, tokenizer: Any, kind: str,
                rng: random.Random) -> str | None:  # fmt: skip
    """A walk through a compiled constraint's bitmasks, a random allowed token a step (the end-of-sequence token
    half the times it is allowed): the text it ended in, or None if it did not end within ``WALK_STEPS``."""
    eos, vocab = tokenizer.eos_token_id, backend.vocab_size
    bitmask = backend.allocate_token_bitmask(1)
    grammar, tokens = backend.new_grammar(compiled), []
    for _ in range(WALK_STEPS):
        bitmask.fill_(-1)
        grammar.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, 0, vocab)
        assert allowed, f"{kind}: a grammar allowed nothing after {tokenizer.decode(tokens)!r}"
        assert max(allowed) < len(tokenizer), f"{kind}: allowed ids the tokenizer does not have"
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert grammar.accept_tokens("walk", [token])
        if grammar.is_terminated():
            return tokenizer.decode(tokens)
        tokens.append(token)
    return None


def ended_walks(backend: StructuredOutputBackend, compiled: Any, tokenizer: Any, kind: str) -> list[str]:
    """The texts of 12 seeded random walks that ended, each checked against the constraint; at least 6 must end."""
    texts = [random_walk(backend, compiled, tokenizer, kind, random.Random(seed)) for seed in range(12)]
    ended = [text for text in texts if text is not None]
    for text in ended:
        assert satisfies(kind, text), f"{kind}: the walk ended in {text!r}"
    assert len(ended) >= 6, f"{kind}: only {len(ended)} of 12 random walks ended within {WALK_STEPS} tokens"
    return ended


class StructuredOutputConformance:
    """Subclass as ``Test...`` with ``backend_cls = MyBackend``."""

    backend_cls: ClassVar[type[StructuredOutputBackend]]
    valid_grammar: ClassVar[str] = 'root ::= "x" | "y" "z"'
    grammar_texts: ClassVar[set[str]] = {"x", "yz"}
    invalid_grammar: ClassVar[str] = "root ::= (("
    vocab_padding: ClassVar[int] = 40  # the model's vocabulary exceeds the tokenizer's by this many ids

    # --- fixtures ---------------------------------------------------------------------------------------

    checkpoint = shared_checkpoint_fixture()

    @fixture(scope="class")
    @classmethod
    def tokenizer(cls, checkpoint: Path) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(checkpoint)

    @fixture(scope="class")
    @classmethod
    def backend(cls, tokenizer: Any) -> StructuredOutputBackend:
        vocab = len(tokenizer) + cls.vocab_padding
        return cls.backend_cls(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))

    @fixture(scope="class")
    @classmethod
    def llm(cls, checkpoint: Path) -> Any:
        """The engine with this backend; async scheduling on, as on a GPU: each step's bitmask is filled while the
        forward runs, after the step in flight is read. A small KV cache, so that long outputs preempt."""
        from nanovllm_core.entrypoints.llm import LLM

        with registered_for_test("structured_output", cls.backend_cls) as name:
            plugins = {"attention": "torch", "structured_output_backend": name}
            llm = LLM(
                str(checkpoint), device="cpu", dtype="float32", max_model_len=512, num_kvcache_blocks=24,
                kvcache_block_size=16, max_num_seqs=8, async_scheduling="on", plugins=plugins,
            )  # fmt: skip
            yield llm
            llm.shutdown()

    # --- the backend alone ------------------------------------------------------------------------------

    def test_validate_refuses_broken_constraints_in_one_line(self, backend: StructuredOutputBackend) -> None:
        import pytest

        broken = [("json", '{"type": "object", "properties": {"a": {"type": 12}}}'), ("regex", "(ab"),
                  ("grammar", self.invalid_grammar)]  # fmt: skip
        for kind, spec in broken:
            if kind not in self.backend_cls.supported_kinds:
                continue
            with pytest.raises(ValueError) as info:
                backend.validate(kind, spec)
            assert str(info.value).strip(), f"{kind}: empty message"
        for kind, params in CONSTRAINTS.items():
            if kind in self.backend_cls.supported_kinds:
                backend.validate(kind, params.spec)

    @parametrize("kind", list(CONSTRAINTS), ids=list(CONSTRAINTS))
    def test_random_walks_satisfy_the_constraint(self, backend: StructuredOutputBackend, tokenizer: Any,
                                                 kind: str) -> None:  # fmt: skip
        import pytest

        if kind not in self.backend_cls.supported_kinds:
            pytest.skip(f"{self.backend_cls.__name__} does not support {kind}")
        compiled = backend.compile(kind, CONSTRAINTS[kind].spec)
        bitmask = backend.allocate_token_bitmask(1)
        assert tuple(bitmask.shape) == (1, bitmask_words(backend.vocab_size))
        ended_walks(backend, compiled, tokenizer, kind)

    @parametrize("kind", ["json", "json_object"], ids=["json", "json_object"])
    def test_disable_any_whitespace_leaves_out_optional_whitespace(self, backend: StructuredOutputBackend,
                                                                   tokenizer: Any, kind: str) -> None:  # fmt: skip
        """Compiled with ``disable_any_whitespace``, JSON has no whitespace outside its strings but one space after
        a ``,`` or ``:`` (the compact forms backends write); compiled without, a space may follow ``{``."""
        import pytest

        if kind not in self.backend_cls.supported_kinds:
            pytest.skip(f"{self.backend_cls.__name__} does not support {kind}")
        spec = CONSTRAINTS[kind].spec
        compact = backend.compile(kind, spec, disable_any_whitespace=True)
        for text in ended_walks(backend, compact, tokenizer, kind):
            between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text).replace(", ", ",").replace(": ", ":")
            assert not re.search(r"\s", between), f"{kind}: optional whitespace in {text!r}"
        space = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == " "]
        assert space, "the kit's tokenizer has no token for a single space"
        for compiled, allowed in ((backend.compile(kind, spec), True), (compact, False)):
            grammar = backend.new_grammar(compiled)
            assert grammar.accept_tokens("ws", tokenizer.encode("{", add_special_tokens=False))
            bitmask = backend.allocate_token_bitmask(1)
            grammar.fill_bitmask(bitmask, 0)
            assert (space[0] in allowed_tokens(bitmask, 0, backend.vocab_size)) is allowed

    def test_a_rollback_restores_the_bitmask(self, backend: StructuredOutputBackend) -> None:
        grammar = backend.new_grammar(backend.compile("json", CONSTRAINTS["json"].spec))
        bitmask = backend.allocate_token_bitmask(2)
        grammar.fill_bitmask(bitmask, 0)
        taken = []
        for _ in range(3):
            bitmask[1].fill_(-1)
            grammar.fill_bitmask(bitmask, 1)
            token = allowed_tokens(bitmask, 1, backend.vocab_size)[0]
            assert grammar.accept_tokens("rollback", [token])
            taken.append(token)
        grammar.rollback(len(taken))
        bitmask[1].fill_(-1)
        grammar.fill_bitmask(bitmask, 1)
        assert bitmask[0].tolist() == bitmask[1].tolist()

    def test_a_batch_fill_writes_each_row_as_its_grammar_would(self, backend: StructuredOutputBackend,
                                                               tokenizer: Any) -> None:  # fmt: skip
        """``fill_bitmasks`` over grammars of every kind, at the start, part-way, complete and terminated, in rows
        that held garbage, gives each row what the grammar's own ``fill_bitmask`` gives."""
        import torch

        eos, vocab = tokenizer.eos_token_id, backend.vocab_size
        rng = random.Random(0)
        grammars = []
        for kind, constraint in CONSTRAINTS.items():
            if kind not in self.backend_cls.supported_kinds:
                continue
            compiled = backend.compile(kind, constraint.spec)
            for steps in (0, 1, 3, 8, WALK_STEPS):  # WALK_STEPS: to the end, then the end-of-sequence token
                grammar = backend.new_grammar(compiled)
                single = backend.allocate_token_bitmask(1)
                for _ in range(steps):
                    single.fill_(-1)
                    grammar.fill_bitmask(single, 0)
                    allowed = allowed_tokens(single, 0, vocab)
                    token = eos if eos in allowed and steps == WALK_STEPS else rng.choice(allowed)
                    assert grammar.accept_tokens("batch", [token])
                    if grammar.is_terminated():
                        break
                grammars.append(grammar)
        assert any(g.is_terminated() for g in grammars), "no kit walk reached its end within the steps"
        expected = backend.allocate_token_bitmask(len(grammars))
        for i, grammar in enumerate(grammars):
            grammar.fill_bitmask(expected, i)
        bitmask = backend.allocate_token_bitmask(len(grammars) + 2)
        bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=torch.Generator().manual_seed(0),
                                    dtype=torch.int64).to(torch.int32))  # fmt: skip
        below = bitmask[-2:].clone()
        backend.fill_bitmasks(grammars, bitmask[: len(grammars)])
        for i in range(len(grammars)):
            assert bitmask[i].tolist() == expected[i].tolist(), f"row {i} differs from its grammar's own fill"
        assert torch.equal(bitmask[-2:], below), "fill_bitmasks wrote past its rows"

    def test_a_grammar_in_its_syntax_compiles(self, backend: StructuredOutputBackend, tokenizer: Any) -> None:
        backend.validate("grammar", self.valid_grammar)
        grammar = backend.new_grammar(backend.compile("grammar", self.valid_grammar))
        bitmask = backend.allocate_token_bitmask(1)
        grammar.fill_bitmask(bitmask, 0)
        first = {tokenizer.decode([t]) for t in allowed_tokens(bitmask, 0, backend.vocab_size)}
        assert first and all(any(text.startswith(f) for text in self.grammar_texts) for f in first), first

    # --- through the engine -----------------------------------------------------------------------------

    @parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
    def test_every_engine_output_satisfies_its_constraint(self, llm: Any, temperature: float) -> None:
        prompts, params = [], []
        for i, constraint in enumerate(CONSTRAINTS.values()):
            prompts += [f"Request {i}: the answer is", [5 + i, 17, 33, 2 * i + 40]]
            params += [SamplingParams(temperature=temperature, max_tokens=120, n=2, seed=i,
                                      structured_outputs=constraint)] * 2  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        kinds = [kind for kind in CONSTRAINTS for _ in range(2)]
        stopped = 0
        for kind, output in zip(kinds, outputs):
            for sample in output.outputs:
                assert sample.finish_reason in ("stop", "length"), sample.finish_reason
                if sample.finish_reason == "stop":
                    stopped += 1
                    assert satisfies(kind, sample.text), f"{kind}: {sample.text!r}"
        assert stopped >= len(kinds) * 2 * 3 // 4, f"only {stopped} outputs completed their constraint"

    def test_free_requests_beside_constrained_ones_get_their_own_tokens(self, llm: Any) -> None:
        free = [[7, 8, 9, 10], [11, 3, 60, 61, 62]]
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
        constrained = SamplingParams(temperature=1.0, max_tokens=60, seed=3, structured_outputs=CONSTRAINTS["json"])
        mixed = llm.generate([free[0], "a person:", free[1]], [greedy, constrained, greedy], use_tqdm=False)
        assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone

    def test_an_invalid_constraint_is_refused_when_added(self, llm: Any) -> None:
        import pytest

        broken = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
        with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex is invalid"):
            llm.add_request([1, 2, 3], broken)
        assert not llm.has_unfinished_requests()
