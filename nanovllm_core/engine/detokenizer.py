"""Text of a growing completion, decoded a few tokens at a time (for streamed outputs)."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Appends the text of new tokens without decoding the whole completion again.

    Each update decodes a short window: the tokens already shown since the last emitted text (``prefix``), once
    alone and once with the new tokens; the difference is the new text. A window that ends inside a multi-byte
    character decodes to U+FFFD and is held back until the character completes. Concatenating the pieces gives
    the same text as decoding the completion at once for the byte-level and word-level tokenizers in use.
    """

    def __init__(self, tokenizer: Any, start: int, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = start
        self.read_offset = start
        self.text = ""

    def update(self, token_ids: list[int]) -> None:
        if self.tokenizer is None or len(token_ids) <= self.read_offset:
            return
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
