"""The ``xgrammar`` backend on a tiny tokenizer (written to disk and loaded as the engine loads one): validation
messages, random walks through each kind of constraint checked against it, rollback, the EOS at the end, and a
model vocabulary wider than the tokenizer's."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
from nanovllm_structured_xgrammar import XgrammarBackend
from nanovllm_structured_xgrammar.backend import choice_ebnf, one_line_reason
from nanovllm_testing import write_tiny_checkpoint
from transformers import AutoTokenizer

from nanovllm_core.structured_output import bitmask_words

PADDING = 19  # the model's logits are this much wider than the tokenizer's vocabulary (not a multiple of 32)
WALKS = 24  # random walks per constraint
MAX_STEPS = 200  # tokens a walk may take before it counts as not terminated
EOS_PROB = 0.5  # a walk takes an allowed EOS with this probability (else it continues where the constraint may)
CLOSE_PROB = 0.4  # ... and an allowed closing token ('"', '}', ']') with this one, so that walks end

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "tags": {"type": "array", "items": {"enum": ["a", 'b"c', "é"]}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "city": {"enum": ["Paris", "Oslo"]},
                },
                "required": ["zip"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
            "note": {"type": "null"},
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "array_of_any_of": {
        "type": "array",
        "items": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0, "maximum": 9}, {"const": "x"}]},
        "minItems": 1,
        "maxItems": 4,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "minimum": -5}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "free_text": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 2, "maxLength": 12}},
        "required": ["text"],
        "additionalProperties": False,
    },
}

REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)",
    r"\d{3}-\d{2,4}",
    r"(ab|cd)+x?",
    r"é+[ü😀]?",
    r"\(\d{1,3}(,\d{1,3})*\)",
    r"[^a-z\n]{1,5}",
]

NESTED_LISTS = """
root ::= list
list ::= "[" (item ("," item)*)? "]"
item ::= list | [a-z]
"""

ASSIGNMENT = 'root ::= "x=" [0-9]{1,3} (";" [a-c]+)?'

CHOICES = ["yes", "yes please", "no", 'a"b', "back\\slash", "new\nline", "tab\there", "é😀", "{}", "nul\x00x"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def backend(tokenizer) -> XgrammarBackend:
    return XgrammarBackend(tokenizer, len(tokenizer) + PADDING, frozenset({tokenizer.eos_token_id}))


def allowed_tokens(row: torch.Tensor) -> list[int]:
    """The token ids whose bit is set in one bitmask row."""
    bits = (row.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def closing_tokens(tokenizer) -> set[int]:
    return {t for t in range(len(tokenizer)) if (text := tokenizer.decode([t])) and set(text) <= set('"}]')}


def walk(backend: XgrammarBackend, compiled, rng: random.Random, closers: set[int]) -> tuple[str, bool]:
    """Take allowed tokens at random until the grammar terminates (on an EOS) or MAX_STEPS; the text and whether
    it terminated. Checks on the way that the mask never allows a token the tokenizer lacks or a special token."""
    grammar = backend.new_grammar(compiled)
    bitmask = backend.allocate_token_bitmask(2)
    eos_ids = backend.eos_token_ids
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        grammar.fill_bitmask(bitmask, 1)
        allowed = allowed_tokens(bitmask[1])
        assert allowed, f"nothing allowed after {backend.tokenizer.decode(tokens)!r}"
        assert max(allowed) < len(backend.tokenizer)
        assert not backend.rules.banned_ids & set(allowed)
        assert bitmask[0].eq(-1).all(), "fill_bitmask wrote outside its row"
        eos = [t for t in allowed if t in eos_ids]
        others = [t for t in allowed if t not in eos_ids]
        close = [t for t in others if t in closers]
        if eos and (not others or rng.random() < EOS_PROB):
            assert grammar.accept_tokens("walk", [rng.choice(eos)])
            assert grammar.is_terminated()
            return decode(backend, tokens), True
        token = rng.choice(close) if close and rng.random() < CLOSE_PROB else rng.choice(others)
        assert grammar.accept_tokens("walk", [token])
        assert not grammar.is_terminated()
        tokens.append(token)
    return decode(backend, tokens), False


def decode(backend: XgrammarBackend, tokens: list[int]) -> str:
    """The text of ``tokens``, as the tokenizer writes it, except that a UTF-8-encoded surrogate stays one character.

    xgrammar takes such a three-byte sequence (invalid UTF-8) for one character of a negated class, where the
    tokenizer writes three replacement characters; length limits count it once (an xgrammar quirk that a model
    practically never meets, kept out of these checks)."""
    data = b"".join(backend.tokenizer_info.decoded_vocab[t] for t in tokens)
    assert backend.tokenizer.decode(tokens, clean_up_tokenization_spaces=False) == data.decode("utf-8", "replace")
    return data.decode("utf-8", "surrogatepass")


def walk_texts(backend: XgrammarBackend, kind: str, spec: str, seed: int) -> list[str]:
    """The texts of WALKS random walks that terminated (most must)."""
    compiled = backend.compile(kind, spec)
    rng = random.Random(seed)
    closers = closing_tokens(backend.tokenizer)
    results = [walk(backend, compiled, rng, closers) for _ in range(WALKS)]
    texts = [text for text, terminated in results if terminated]
    assert len(texts) >= WALKS * 3 // 4, f"only {len(texts)} of {WALKS} walks terminated"
    return texts


# --- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, spec",
    [
        *(("json", json.dumps(schema, sort_keys=True)) for schema in SCHEMAS.values()),
        ("json", "true"),
        *(("regex", regex) for regex in REGEXES),
        ("grammar", NESTED_LISTS),
        ("grammar", ASSIGNMENT),
        ("choice", json.dumps(CHOICES)),
        ("json_object", ""),
    ],
)
def test_validate_accepts_good_constraints(backend, kind, spec):
    backend.validate(kind, spec)


@pytest.mark.parametrize(
    "kind, spec, reason",
    [
        ("json", '{"type": "strin"}', 'Unsupported type "strin"'),
        ("json", '{"type": "integer", "minimum": 5, "maximum": 2}', "minimum greater than maximum"),
        ("json", '{"$ref": "#/$defs/missing"}', "missing"),
        ("json", "{not json", "Failed to parse JSON"),
        ("regex", "a(b", "parenthesis is not closed"),
        ("regex", "(?<=a)b", "Lookbehind is not supported"),
        ("grammar", 'root ::= foo\n  | "a"', 'Rule "foo" is not defined'),
        ("grammar", 'start ::= "a"', 'root rule with name "root" is not found'),
        ("grammar", 'start: "a" | "b"', "not Lark"),
        ("choice", "[]", "non-empty JSON list"),
        ("choice", '["a", 1]', "non-empty string"),
        ("choice", '["a", ""]', "non-empty string"),
        ("choice", "not json", "not a JSON list"),
        ("choice", '["\\ud800"]', "lone surrogate"),
        ("nonsense", "", "unknown constraint kind"),
    ],
)
def test_validate_rejects_with_a_one_line_reason(backend, kind, spec, reason):
    with pytest.raises(ValueError) as info:
        backend.validate(kind, spec)
    message = str(info.value)
    assert reason in message
    assert "\n" not in message and len(message) <= 320
    assert "/cpp/" not in message and not message.startswith("[")  # no C++ log prefix


def test_one_line_reason_strips_the_native_noise():
    exc = RuntimeError(
        "[14:56:47] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is false: Failed "
        "to parse JSON: syntax error at line 1 near: x. The JSON string is:" + "x" * 500 + "\nStack trace:\n  0: f"
    )
    assert one_line_reason(exc) == "Failed to parse JSON: syntax error at line 1 near: x."
    assert len(one_line_reason(RuntimeError("word " * 200))) == 240


def test_compile_raises_the_same_one_line_value_error(backend):
    with pytest.raises(ValueError, match="parenthesis is not closed") as info:
        backend.compile("regex", "a(b")
    assert "\n" not in str(info.value)


# --- random walks checked against the constraint --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_satisfy_the_schema(backend, name):
    schema = SCHEMAS[name]
    for text in walk_texts(backend, "json", json.dumps(schema, sort_keys=True), seed=sorted(SCHEMAS).index(name)):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_match_in_full(backend, regex):
    for text in walk_texts(backend, "regex", regex, seed=len(regex)):
        assert re.fullmatch(regex, text), text


def test_choice_walks_give_one_of_the_choices(backend):
    texts = walk_texts(backend, "choice", json.dumps(CHOICES), seed=3)
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) > 3  # the walks reach several of them, the prefix "yes" of "yes please" too


def test_json_object_walks_give_objects(backend):
    for text in walk_texts(backend, "json_object", "", seed=4):
        assert isinstance(json.loads(text), dict), text


def test_grammar_walks_follow_the_grammar(backend):
    for text in walk_texts(backend, "grammar", NESTED_LISTS, seed=5):
        assert re.fullmatch(r"[\[\],a-z]+", text), text
        assert isinstance(json.loads(re.sub(r"[a-z]", r'"\g<0>"', text)), list), text
    for text in walk_texts(backend, "grammar", ASSIGNMENT, seed=6):
        assert re.fullmatch(r"x=[0-9]{1,3}(;[a-c]+)?", text), text


def test_compact_json_without_any_whitespace(tokenizer):
    compact = XgrammarBackend(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), any_whitespace=False)
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    for text in walk_texts(compact, "json", json.dumps(schema), seed=7):
        assert text == json.dumps(json.loads(text))  # one line, json.dumps's separators


def test_choices_are_escaped_as_ebnf_literals():
    assert choice_ebnf(json.dumps(['a"b', "c\\d", "e\nf", "g\x01", "é", "a"])) == (
        'root ::= "a\\"b" | "c\\\\d" | "e\\nf" | "g\\x01" | "é" | "a"'
    )


# --- the grammar object's contract ---------------------------------------------------------------------------


def mask_after(backend, grammar) -> torch.Tensor:
    bitmask = backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_rollback_restores_every_earlier_mask(backend, tokenizer):
    grammar = backend.new_grammar(backend.compile("json", json.dumps(SCHEMAS["refs"], sort_keys=True)))
    tokens = encode(tokenizer, '{"a": {"x": 12, "y": -3}}')
    masks = [mask_after(backend, grammar)]
    for token in tokens:
        assert grammar.accept_tokens("r", [token])
        masks.append(mask_after(backend, grammar))
    assert grammar.accept_tokens("r", [tokenizer.eos_token_id]) and grammar.is_terminated()
    grammar.rollback(1)  # the EOS
    assert not grammar.is_terminated()
    assert torch.equal(mask_after(backend, grammar), masks[-1])
    grammar.rollback(3)
    assert torch.equal(mask_after(backend, grammar), masks[-4])
    grammar.rollback(len(tokens) - 3)
    assert torch.equal(mask_after(backend, grammar), masks[0])
    grammar.rollback(0)
    assert torch.equal(mask_after(backend, grammar), masks[0])
    assert grammar.accept_tokens("r", tokens)  # the same path again, after the rollbacks
    grammar.reset()
    assert torch.equal(mask_after(backend, grammar), masks[0])


def test_a_rejected_token_stops_the_advance_there(backend, tokenizer):
    grammar = backend.new_grammar(backend.compile("regex", r"ab|cd"))
    a, b, c = (encode(tokenizer, ch)[0] for ch in "abc")
    initial = mask_after(backend, grammar)
    assert not grammar.accept_tokens("r", [b])
    assert torch.equal(mask_after(backend, grammar), initial)
    assert not grammar.accept_tokens("r", [a, c, b])  # a advances, c is rejected, b is never looked at
    assert allowed_tokens(mask_after(backend, grammar)) == [b]
    assert grammar.accept_tokens("r", [b])


def test_the_eos_is_allowed_exactly_when_the_constraint_is_complete(backend, tokenizer):
    eos = tokenizer.eos_token_id
    grammar = backend.new_grammar(backend.compile("regex", r"ab(c)?"))
    a, b, c = (encode(tokenizer, ch)[0] for ch in "abc")
    assert eos not in allowed_tokens(mask_after(backend, grammar))
    assert not grammar.accept_tokens("r", [eos]) and not grammar.is_terminated()
    assert grammar.accept_tokens("r", [a, b])
    assert sorted(allowed_tokens(mask_after(backend, grammar))) == sorted([c, eos])  # may end or go on
    assert grammar.accept_tokens("r", [c])
    assert allowed_tokens(mask_after(backend, grammar)) == [eos]
    assert grammar.accept_tokens("r", [eos]) and grammar.is_terminated()
    assert allowed_tokens(mask_after(backend, grammar)) == [eos]  # once terminated: the EOS alone
    assert not grammar.accept_tokens("r", [a])


def test_special_tokens_are_never_text(backend, tokenizer):
    """xgrammar reads ``<|pad|>`` and ``<|endoftext|>`` as their text; the backend masks them where that text
    would fit (a permissive class) and refuses them too, so neither the mask nor acceptance lets them in."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    grammar = backend.new_grammar(backend.compile("regex", r"[<|a-z>]+"))
    assert not {pad, eos} & set(allowed_tokens(mask_after(backend, grammar)))
    assert not grammar.accept_tokens("r", [pad])
    assert not grammar.accept_tokens("r", [eos]) and not grammar.is_terminated()
    assert grammar.accept_tokens("r", encode(tokenizer, "ab"))
    allowed = allowed_tokens(mask_after(backend, grammar))
    assert eos in allowed and pad not in allowed


def test_mask_width_follows_the_model_vocabulary(backend, tokenizer):
    vocab_size = len(tokenizer) + PADDING
    assert backend.allocate_token_bitmask(3).shape == (3, bitmask_words(vocab_size))
    grammar = backend.new_grammar(backend.compile("json_object", ""))
    assert grammar.accept_tokens("r", encode(tokenizer, '{"k": "'))  # inside a string: almost every token fits
    allowed = allowed_tokens(mask_after(backend, grammar))
    assert len(allowed) > len(tokenizer) // 2
    assert max(allowed) < len(tokenizer)  # the padding ids (and the bits past vocab_size) stay clear
    assert not grammar.accept_tokens("r", [len(tokenizer), vocab_size - 1, vocab_size + 5])


def test_threaded_batch_fill_gives_the_serial_rows(backend, tokenizer, monkeypatch):
    """A step's rows on xgrammar's threads (as a large vocabulary's are) equal the rows filled one thread."""
    import nanovllm_structured_xgrammar.backend as module

    rng, closers = random.Random(3), closing_tokens(tokenizer)
    grammars = []
    for kind, spec in (("json", json.dumps(SCHEMAS["person"])), ("regex", REGEXES[0]), ("json_object", "")):
        compiled = backend.compile(kind, spec)
        for steps in (0, 2, 5, 9):
            grammar = backend.new_grammar(compiled)
            for _ in range(steps):
                others = [t for t in allowed_tokens(mask_after(backend, grammar)) if t not in backend.eos_token_ids]
                if not others:
                    break
                token = rng.choice([t for t in others if t in closers] or others)
                assert grammar.accept_tokens("r", [token])
            grammars.append(grammar)
    ended = backend.new_grammar(backend.compile("choice", '["ok"]'))
    assert ended.accept_tokens("r", [*encode(tokenizer, "ok"), tokenizer.eos_token_id]) and ended.is_terminated()
    grammars.insert(1, ended)  # a row xgrammar does not fill: the rows after it keep their places
    masks = {}
    for name, work in (("serial", 10**12), ("threaded", 0)):
        monkeypatch.setattr(module, "PARALLEL_FILL_WORK", work)
        bitmask = backend.allocate_token_bitmask(len(grammars))
        backend.fill_bitmasks(grammars, bitmask)
        masks[name] = bitmask
    assert torch.equal(masks["serial"], masks["threaded"])
    assert len({tuple(row.tolist()) for row in masks["serial"]}) > 4  # the grammars are in different states


def test_several_eos_ids(tokenizer):
    eos_ids = frozenset({tokenizer.eos_token_id, tokenizer.pad_token_id})
    backend = XgrammarBackend(tokenizer, len(tokenizer), eos_ids)
    grammar = backend.new_grammar(backend.compile("choice", '["ok"]'))
    assert grammar.accept_tokens("r", encode(tokenizer, "ok"))
    assert set(allowed_tokens(mask_after(backend, grammar))) == eos_ids
    assert grammar.accept_tokens("r", [tokenizer.pad_token_id]) and grammar.is_terminated()


def test_compiles_in_parallel_threads(backend, tokenizer):
    schemas = [{"properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(lambda s: backend.compile("json", json.dumps(s)), schemas))
    for i, c in enumerate(compiled):
        grammar = backend.new_grammar(c)
        assert grammar.accept_tokens("r", encode(tokenizer, f'{{"k{i}": 7}}') + [tokenizer.eos_token_id])
        assert grammar.is_terminated()


# --- options ----------------------------------------------------------------------------------------------------


def test_unknown_or_mistyped_options_name_the_accepted_ones(tokenizer):
    eos = frozenset({tokenizer.eos_token_id})
    with pytest.raises(ValueError, match="any_whitespace") as info:
        XgrammarBackend(tokenizer, len(tokenizer), eos, any_whitespce=False)
    assert "max_threads" in str(info.value)
    with pytest.raises(ValueError, match="any_whitespace"):
        XgrammarBackend(tokenizer, len(tokenizer), eos, any_whitespace="no")
    with pytest.raises(ValueError, match="max_threads"):
        XgrammarBackend(tokenizer, len(tokenizer), eos, max_threads=0)


def test_built_by_the_engine_with_validated_options(tokenizer):
    from nanovllm_core.engine.options import instantiate

    backend = instantiate(
        "structured_output", XgrammarBackend, {"any_whitespace": False}, tokenizer=tokenizer,
        vocab_size=len(tokenizer), eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )  # fmt: skip
    assert backend.options.any_whitespace is False and backend.options.max_threads == 8
