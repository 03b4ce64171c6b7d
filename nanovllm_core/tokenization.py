"""Text to token ids with a named error: what every entry point (offline, chat, server) tokenizes through."""

from __future__ import annotations

from typing import Any

from nanovllm_core.errors import InvalidRequestError


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode text (it holds a lone surrogate, as text decoded from non-UTF-8 bytes
    with ``errors="surrogateescape"`` does), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds the lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}, which is not valid "
            "Unicode (text decoded from non-UTF-8 bytes with errors='surrogateescape' looks like this): decode the "
            "bytes with their real encoding"
        )
    return None


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True, what: str = "the prompt") -> list[int]:
    """``tokenizer.encode(text)``; an InvalidRequestError (naming ``what``) for text the tokenizer cannot take."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # noqa: BLE001 - tokenizers raise TypeError/ValueError on text they cannot take
        problem = unicode_problem(text) if isinstance(text, str) else None
        if problem is not None:
            raise InvalidRequestError(f"{what} cannot be tokenized: {problem}") from None
        raise InvalidRequestError(f"{what} cannot be tokenized ({type(exc).__name__}: {exc})") from None
