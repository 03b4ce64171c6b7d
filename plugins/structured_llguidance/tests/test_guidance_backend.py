"""The ``guidance`` backend on the tiny checkpoint's byte-level BPE tokenizer (CPU, no downloads).

The property tests walk random paths through a constraint: fill the bitmask, take a random allowed token (the
end-of-sequence token half the time it is allowed), accept it, until the grammar terminates; the decoded text
must then satisfy the constraint, checked by an independent judge (``jsonschema``, ``re``, Python's parser).
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from nanovllm_structured_llguidance import GuidanceBackend, GuidanceGrammar, plugin
from nanovllm_structured_llguidance.specs import forbid_additional_properties
from nanovllm_testing.checkpoints import build_tokenizer, write_tiny_checkpoint
from packaging.specifiers import SpecifierSet

from nanovllm_core import bitmask_words
from nanovllm_core.engine.options import instantiate, validate_options
from nanovllm_core.errors import ConfigError
from nanovllm_core.hookspecs import PLUGIN_API_VERSION
from nanovllm_core.sampling_params import StructuredOutputsParams

PADDING = 40  # the model's vocabulary exceeds the tokenizer's by this many ids (embedding padding)
MAX_STEPS = 300
WALKS = 12

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "alan", "grace"]},
        "nick": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["paris", "rome"]}, "zip": {"type": "integer", "maximum": 99}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
POINTS = {  # an array of objects, each with its own bounded members
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "on": {"type": "boolean"}},
        "required": ["x", "on"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
ODD_CHOICES = ['say "hi"', "back\\slash", "new\nline", "café ☕", "😀", "a", "ab", "tab\t", "{x}", "<|x|>", "it's"]
ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/  # no leading zeros: Python, the judge, refuses them
"""


def arithmetic(text: str) -> bool:
    """Python's parser as the judge: the text is an expression of integers, +, - and parentheses only."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                return False
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.Add, ast.Sub)):
            return False
    return True


def schema_judge(schema: dict[str, Any]) -> Callable[[str], bool]:
    def judge(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return judge


def regex_judge(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


CASES: dict[str, tuple[StructuredOutputsParams, Callable[[str], bool]]] = {
    "json-person": (StructuredOutputsParams(json=PERSON), schema_judge(PERSON)),
    "json-points": (StructuredOutputsParams(json=POINTS), schema_judge(POINTS)),
    "regex-code": (StructuredOutputsParams(regex=r"(yes|no)-[0-9]{2,4}"), regex_judge(r"(yes|no)-[0-9]{2,4}")),
    "regex-mail": (
        StructuredOutputsParams(regex=r"[a-z]{1,6}(\.[a-z]{1,6})?@[a-z]{2,5}\.(com|org)"),
        regex_judge(r"[a-z]{1,6}(\.[a-z]{1,6})?@[a-z]{2,5}\.(com|org)"),
    ),
    "regex-unicode": (StructuredOutputsParams(regex=r"caf[éè] ?[0-9]{1,3}"), regex_judge(r"caf[éè] ?[0-9]{1,3}")),
    "choice-odd": (StructuredOutputsParams(choice=ODD_CHOICES), lambda text: text in ODD_CHOICES),
    "grammar-lark": (StructuredOutputsParams(grammar=ARITHMETIC), arithmetic),
    "grammar-gbnf": (StructuredOutputsParams(grammar='root ::= "x" | "y" [0-9]'), regex_judge(r"x|y[0-9]")),
    "json_object": (StructuredOutputsParams(json_object=True), is_object),
}


# --- fixtures and helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GuidanceBackend:
    return GuidanceBackend(tokenizer, len(tokenizer) + PADDING, frozenset({tokenizer.eos_token_id}))


def allowed(bitmask: Any, index: int = 0) -> list[int]:
    words = bitmask[index].tolist()
    return [t for t in range(32 * len(words)) if (words[t // 32] >> (t % 32)) & 1]


def mask_of(grammar: GuidanceGrammar, backend: GuidanceBackend) -> list[int]:
    bitmask = backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    return allowed(bitmask)


def walk(backend: GuidanceBackend, grammar: GuidanceGrammar, rng: random.Random) -> tuple[list[int], bool]:
    """A random path through ``grammar``: the tokens before the end-of-sequence token, and whether it ended."""
    eos = next(iter(backend.eos_token_ids))
    bitmask = backend.allocate_token_bitmask(1)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        bitmask.fill_(-1)
        grammar.fill_bitmask(bitmask, 0)
        choices = allowed(bitmask)
        assert choices, f"nothing allowed after {tokens}"
        token = eos if eos in choices and rng.random() < 0.5 else rng.choice(choices)
        assert grammar.accept_tokens("walk", [token]), f"an allowed token {token} was refused after {tokens}"
        if grammar.is_terminated():
            return tokens, True
        assert token != eos
        tokens.append(token)
    return tokens, False


# --- validate ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_validate_accepts_good_constraints(backend: GuidanceBackend, case: str) -> None:
    params = CASES[case][0]
    backend.validate(params.kind, params.spec)


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json", '{"type": "object", "properties": {"a": {"type": 12}}}', "type must be a string"),
        ("json", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum (5) is greater than maximum (1)"),
        ("json", '{"type": "string", "pattern": "(a"}', "unclosed group"),
        ("json", '{"properties": {"a": {"$ref": "#/$defs/nope"}}}', "does not exist"),
        ("json", "{", "not valid JSON"),
        ("json", "false", "no value satisfies it"),
        ("json", "[1]", "a JSON schema is an object"),
        ("regex", "(ab", "unclosed group"),
        ("regex", r"\p{Nope}", "Unicode property not found"),
        ("grammar", "start: foo", 'unknown name: "foo"'),
        ("grammar", "start: /[/", "unclosed character class"),
        ("grammar", "root ::= ((", "read as GBNF"),
        ("grammar", 'foo: "a"', "Lark with a `start` rule"),
        ("choice", "[]", "non-empty JSON list"),
        ("choice", '["a", 1]', "non-empty JSON list"),
        ("choice", json.dumps(["\ud800"]), "not valid Unicode"),
    ],
)
def test_validate_refuses_bad_constraints_in_one_line(backend: GuidanceBackend, kind: str, spec: str,
                                                       reason: str) -> None:  # fmt: skip
    with pytest.raises(ValueError) as info:
        backend.validate(kind, spec)
    message = str(info.value)
    assert reason in message
    assert "\n" not in message and "| " not in message, message  # no echo of the grammar's lines


def test_positions_are_kept_for_grammars_only(backend: GuidanceBackend) -> None:
    """A regex is wrapped in a grammar by llguidance: a line(column) would point into that, not the regex."""
    with pytest.raises(ValueError, match=r"^at 1\(8\): unknown name"):
        backend.validate("grammar", "start: foo")
    with pytest.raises(ValueError, match=r"^invalid regex"):
        backend.validate("regex", "(ab")


def test_a_special_token_the_tokenizer_lacks_fails_at_compile(backend: GuidanceBackend) -> None:
    """validate reads the grammar without the vocabulary (cheap); compile knows the tokenizer's tokens."""
    backend.validate("grammar", 'start: "a" <|nope|>')
    with pytest.raises(ValueError, match=r"unknown special token"):
        backend.compile("grammar", 'start: "a" <|nope|>')


# --- random walks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_random_walks_satisfy_the_constraint(backend: GuidanceBackend, tokenizer: Any, case: str) -> None:
    params, judge = CASES[case]
    compiled = backend.compile(params.kind, params.spec)
    ended = 0
    for seed in range(WALKS):
        tokens, terminated = walk(backend, backend.new_grammar(compiled), random.Random(seed))
        if terminated:
            ended += 1
            text = tokenizer.decode(tokens)
            assert judge(text), f"{case}: the walk of seed {seed} ended in {text!r}"
    assert ended >= WALKS * 2 // 3, f"{case}: only {ended} of {WALKS} walks ended within {MAX_STEPS} tokens"


def test_compact_json_has_no_whitespace(tokenizer: Any) -> None:
    compact = GuidanceBackend(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}),
                              whitespace_flexible=False)  # fmt: skip
    compiled = compact.compile("json", StructuredOutputsParams(json=POINTS).spec)
    for seed in range(WALKS):
        tokens, terminated = walk(compact, compact.new_grammar(compiled), random.Random(seed))
        assert terminated
        text = tokenizer.decode(tokens)
        assert schema_judge(POINTS)(text) and not re.search(r"\s", text), text


def test_every_odd_choice_and_nothing_else(backend: GuidanceBackend, tokenizer: Any) -> None:
    """Each choice, however it tokenizes, is accepted whole and ends there; a longer text is refused."""
    eos = tokenizer.eos_token_id
    compiled = backend.compile("choice", StructuredOutputsParams(choice=ODD_CHOICES).spec)
    for choice in ODD_CHOICES:
        grammar = backend.new_grammar(compiled)
        assert grammar.accept_tokens("c", tokenizer.encode(choice)), choice
        assert eos in mask_of(grammar, backend), choice
        assert grammar.accept_tokens("c", [eos]) and grammar.is_terminated(), choice
    grammar = backend.new_grammar(compiled)
    assert not grammar.accept_tokens("c", tokenizer.encode("abc"))


# --- accept, terminate, roll back --------------------------------------------------------------------------


def test_termination_needs_the_end_of_sequence_token(backend: GuidanceBackend, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    grammar = backend.new_grammar(backend.compile("choice", json.dumps(["yes", "no"])))
    assert grammar.accept_tokens("t", tokenizer.encode("yes"))
    assert not grammar.is_terminated()  # complete, but the sequence has not ended
    assert mask_of(grammar, backend) == [eos]
    assert grammar.accept_tokens("t", [eos]) and grammar.is_terminated()
    assert mask_of(grammar, backend) == [eos]  # once terminated: only the end-of-sequence tokens
    assert grammar.accept_tokens("t", [eos, eos])
    assert not grammar.accept_tokens("t", tokenizer.encode("y"))
    grammar.rollback(2)
    assert grammar.is_terminated()
    grammar.rollback(1)
    assert not grammar.is_terminated() and mask_of(grammar, backend) == [eos]


def test_a_rollback_past_the_end_reopens_the_constraint(backend: GuidanceBackend, tokenizer: Any) -> None:
    """A constraint that could go on (``[0-9]+``) ends on an end-of-sequence token the matcher itself holds."""
    eos = tokenizer.eos_token_id
    grammar = backend.new_grammar(backend.compile("regex", "[0-9]+"))
    assert grammar.accept_tokens("d", tokenizer.encode("12"))
    open_mask = mask_of(grammar, backend)
    assert eos in open_mask and len(open_mask) > 1
    assert grammar.accept_tokens("d", [eos, eos]) and grammar.is_terminated()
    assert mask_of(grammar, backend) == [eos]
    grammar.rollback(2)
    assert not grammar.is_terminated() and mask_of(grammar, backend) == open_mask
    assert grammar.accept_tokens("d", tokenizer.encode("3") + [eos]) and grammar.is_terminated()


def test_a_refused_token_leaves_the_grammar_where_it_was(backend: GuidanceBackend, tokenizer: Any) -> None:
    grammar = backend.new_grammar(backend.compile("regex", r"(yes|no)-[0-9]{2}"))
    assert grammar.accept_tokens("r", tokenizer.encode("ye"))
    before = mask_of(grammar, backend)
    bad = next(t for t in range(len(tokenizer)) if t not in before)
    assert not grammar.accept_tokens("r", [bad])
    assert not grammar.accept_tokens("r", [len(tokenizer) + 1])  # a padding id: never a token
    assert mask_of(grammar, backend) == before
    assert grammar.accept_tokens("r", tokenizer.encode("s-42") + [tokenizer.eos_token_id])
    assert grammar.is_terminated()


@pytest.mark.parametrize("case", ["json-person", "grammar-lark", "regex-mail"])
def test_a_rollback_restores_the_bitmask(backend: GuidanceBackend, case: str) -> None:
    params = CASES[case][0]
    compiled = backend.compile(params.kind, params.spec)
    rng = random.Random(7)
    for k in (1, 3, 8, 40):
        grammar = backend.new_grammar(compiled)
        masks, taken = [mask_of(grammar, backend)], []
        for _ in range(k):
            choices = [t for t in masks[-1] if t not in backend.eos_token_ids]
            if not choices:  # complete: only the end-of-sequence token is left
                break
            token = rng.choice(choices)
            assert grammar.accept_tokens("r", [token])
            taken.append(token)
            masks.append(mask_of(grammar, backend))
        k = len(taken)
        back = rng.randint(1, k)
        grammar.rollback(back)
        assert mask_of(grammar, backend) == masks[k - back]
        grammar.rollback(k - back)
        assert mask_of(grammar, backend) == masks[0]
        assert grammar.accept_tokens("r", taken) and mask_of(grammar, backend) == masks[k]
        with pytest.raises(ValueError, match="cannot roll back"):
            grammar.rollback(k + 1)
        grammar.reset()
        assert mask_of(grammar, backend) == masks[0]


def test_grammars_of_one_compiled_constraint_are_independent(backend: GuidanceBackend, tokenizer: Any) -> None:
    compiled = backend.compile("regex", r"(yes|no)-[0-9]{2}")
    first, second = backend.new_grammar(compiled), backend.new_grammar(compiled)
    start = mask_of(first, backend)
    assert first.accept_tokens("a", tokenizer.encode("yes-4"))
    assert mask_of(second, backend) == start
    assert mask_of(backend.new_grammar(compiled), backend) == start  # the compiled matcher never advances


def test_several_end_of_sequence_tokens(tokenizer: Any) -> None:
    eos = frozenset({tokenizer.eos_token_id, tokenizer.pad_token_id})
    backend = GuidanceBackend(tokenizer, len(tokenizer), eos)
    compiled = backend.compile("regex", "ok")
    for token in eos:
        grammar = backend.new_grammar(compiled)
        assert grammar.accept_tokens("e", tokenizer.encode("ok"))
        assert set(mask_of(grammar, backend)) == eos
        assert grammar.accept_tokens("e", [token]) and grammar.is_terminated()


# --- the vocabulary ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer_size", [384, 371])  # a whole number of bitmask words, and not
def test_ids_beyond_the_tokenizer_are_never_allowed(tokenizer_size: int) -> None:
    tokenizer = build_tokenizer(tokenizer_size)
    vocab = len(tokenizer) + PADDING
    backend = GuidanceBackend(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    bitmask = backend.allocate_token_bitmask(2)
    assert tuple(bitmask.shape) == (2, bitmask_words(vocab))
    for kind, spec in [("regex", r"(.|\n)*"), ("json_object", ""), ("grammar", r"start: /(.|\n)+/")]:
        grammar = backend.new_grammar(backend.compile(kind, spec))
        rng = random.Random(0)
        for _ in range(20):
            bitmask.fill_(-1)
            grammar.fill_bitmask(bitmask, 1)
            choices = allowed(bitmask, 1)
            assert choices and max(choices) < len(tokenizer), kind
            assert allowed(bitmask, 0) == list(range(32 * bitmask.shape[1]))  # other rows untouched
            assert grammar.accept_tokens("v", [rng.choice(choices)])
    with pytest.raises(ValueError, match="too large"):  # no grammar reaches a padding id by its number either
        backend.compile("grammar", f"start: <[{len(tokenizer) + 1}]>")


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_a_config_error(tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match="the tokenizer has 384 tokens but the model's vocabulary only 300"):
        GuidanceBackend(tokenizer, 300, frozenset({tokenizer.eos_token_id}))


# --- options -----------------------------------------------------------------------------------------------


def test_options_are_validated_like_the_engine_does(tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match="whitespace_flexibel.*did you mean 'whitespace_flexible'"):
        validate_options("structured_output", GuidanceBackend, {"whitespace_flexibel": False})
    with pytest.raises(ConfigError, match="disable_additional_properties"):
        validate_options("structured_output", GuidanceBackend, {"disable_additional_properties": "yes"})
    backend = instantiate(
        "structured_output", GuidanceBackend, {"disable_additional_properties": True}, tokenizer=tokenizer,
        vocab_size=len(tokenizer), eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )  # fmt: skip
    assert backend.disable_additional_properties and backend.json_options == {"whitespace_flexible": True}


def test_disable_additional_properties(tokenizer: Any) -> None:
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}).spec
    text = tokenizer.encode('{"a": 1, "b": 2}')
    for disable, expected in [(False, True), (True, False)]:
        backend = GuidanceBackend(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}),
                                  disable_additional_properties=disable)  # fmt: skip
        assert backend.new_grammar(backend.compile("json", schema)).accept_tokens("p", text) is expected


def test_forbid_additional_properties_fills_in_only_what_is_unsaid() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"properties": {"x": {}}}, "open": {"properties": {}, "additionalProperties": True}},
        "anyOf": [{"patternProperties": {"^y": {}}}, {"type": "string"}],
    }
    out = forbid_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in out["anyOf"][1]
    assert "additionalProperties" not in schema  # a copy


# --- threads and the plugin --------------------------------------------------------------------------------


def test_compiles_run_at_once_in_threads(backend: GuidanceBackend, tokenizer: Any) -> None:
    jobs = [(p.kind, p.spec) for p, _ in CASES.values()] * 4
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(lambda job: backend.compile(*job), jobs))
    for (params, judge), result in zip(list(CASES.values()) * 4, compiled):
        tokens, terminated = walk(backend, backend.new_grammar(result), random.Random(1))
        assert not terminated or judge(tokenizer.decode(tokens)), params


def test_the_plugin_registers_guidance() -> None:
    registered: dict[str, type] = {}
    plugin.nanovllm_register_structured_output_backends(registered.__setitem__)
    assert registered == {"guidance": GuidanceBackend}
    assert SpecifierSet(plugin.NANOVLLM_PLUGIN_API).contains(str(PLUGIN_API_VERSION))
    assert GuidanceBackend.name == "guidance" and GuidanceBackend.priority == 5
    assert GuidanceBackend.grammar_syntax == "Lark (llguidance)"


def test_loading_the_plugin_leaves_torch_compile_and_transformers_unimported() -> None:
    """Every `nanovllm` command loads the plugins: importing `llguidance.torch` (a torch.compile decorator) or
    `llguidance.hf` (transformers) with the plugin would add seconds to each command's start."""
    code = (
        "import sys\n"
        "from nanovllm_core.plugins import build_registry\n"
        "assert 'guidance' in build_registry().names('structured_output')\n"
        "print(sorted(m for m in ('torch._inductor', 'llguidance.torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
