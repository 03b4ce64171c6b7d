"""How large a request the front-end takes: the request-body limit (``--max-request-body-bytes``) and the longest
text prompt worth tokenizing, both sized from ``max_model_len``, so that an oversized request is refused before
its body is parsed or its text tokenized (work that would hold up every other request)."""

from __future__ import annotations

from typing import Any

from nanovllm_core.errors import ConfigError

# The default body limit: this many bytes per token of max_model_len plus room for the rest of the JSON (sampling
# fields, tools, chat structure). Generous: English text takes a few bytes a token, a CJK character written as a
# \u escape 6, a token id at most 7 ("151643,"); a batch of several long prompts may need more (raise the flag).
BODY_BYTES_PER_TOKEN = 64
BODY_JSON_ROOM = 1 << 20
# A normalizer may shorten text before tokenization (NFC composes up to three characters into one): the longest
# token's characters times this is as many characters as one token can ever stand for.
NORMALIZER_SLACK = 4


def default_max_request_body_bytes(max_model_len: int) -> int:
    """``--max-request-body-bytes``' default."""
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_JSON_ROOM


def check_max_request_body_bytes(value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"--max-request-body-bytes {value}: at least 1 (leave it out for the default)")


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """More characters than any text of ``max_model_len`` tokens of this tokenizer can have (None: unknown): a
    token's worth is the vocabulary's longest token as the vocabulary writes it (byte-level BPE: one character a
    byte, so at least the characters of the text it stands for) times ``NORMALIZER_SLACK``. A text prompt longer
    than this is refused without tokenizing it."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: no pre-check
        return None
    longest = max((len(token) for token in vocab), default=0)
    return max_model_len * longest * NORMALIZER_SLACK if longest else None
