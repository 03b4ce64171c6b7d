"""Text of a growing completion, decoded a few tokens at a time (for streamed outputs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decode = Callable[[list[int], bool], str]


def decoder_of(tokenizer: Any) -> Decode:
    """``decode(token_ids, skip_special_tokens)`` for ``tokenizer``: straight to the Rust ``tokenizers`` decoder
    when the result is the same as ``tokenizer.decode`` (a fast tokenizer that does not clean up tokenization
    spaces). ``transformers``' own ``decode`` first walks the id list in Python, which costs more than the decode
    itself, and streamed outputs decode every running request every step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Appends the text of new tokens without decoding the whole completion again.

    Each update decodes a short window: the tokens already shown since the last emitted text (``prefix``), once
    alone and once with the new tokens; the difference is the new text. A window that ends inside a multi-byte
    character decodes to U+FFFD and is held back until the character completes. Concatenating the pieces gives
    the same text as decoding the completion at once for the byte-level and word-level tokenizers in use.
    """

    def __init__(self, decode: Decode | None, start: int, skip_special_tokens: bool) -> None:
        self.decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = start
        self.read_offset = start
        self.text = ""

    def update(self, token_ids: list[int]) -> None:
        if self.decode is None or len(token_ids) <= self.read_offset:
            return
        decode, skip = self.decode, self.skip_special_tokens
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip)
        full = decode(token_ids[self.prefix_offset :], skip)
        # New tokens that add no text at all (skipped special tokens, ids the tokenizer does not know) move the
        # window on too: kept in it, they would make every later decode longer, up to the whole completion.
        if full == prefix or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
