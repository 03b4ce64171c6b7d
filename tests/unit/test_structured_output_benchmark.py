"""benchmarks/structured_output.py's synthetic vocabulary: the size asked for, the checkpoint's special ids, and a
byte-level tokenizer that round-trips JSON text (what the grammar engines read it as)."""

from __future__ import annotations

from pathlib import Path

from nanovllm_testing.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_output.py"


def test_synthetic_tokenizer_has_the_size_and_ids_asked_for_and_round_trips_text() -> None:
    bench = load_script(SCRIPT)
    tokenizer = bench.synthetic_tokenizer(3000)
    assert len(tokenizer) == 3000
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(3000))
    assert max(len(token) for token in vocab) <= 13  # "<|endoftext|>" is the longest
    text = '{"name": "Ada", "tags": ["x-1", "y_2"], "n": 12.5}\n'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # merges are used
    assert bench.synthetic_tokenizer(3000).get_vocab() == vocab  # seeded: the same vocabulary every run
