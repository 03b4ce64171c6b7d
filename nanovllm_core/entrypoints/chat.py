"""Chat messages to prompt token ids through the tokenizer's chat template (``LLM.chat`` and the server)."""

from __future__ import annotations

from typing import Any

from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.tokenization import encode_text

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer: Any,
    messages: Conversation,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """The prompt token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``).

    The template's text is tokenized without adding special tokens again (the template writes its own), unless
    ``add_special_tokens``.
    Raises InvalidRequestError when the tokenizer has no chat template (and none is given), the template
    rejects the messages, or their text is not valid Unicode.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        source = getattr(tokenizer, "name_or_path", "") or "this model"
        raise InvalidRequestError(
            f"the tokenizer of {source} has no chat template (no chat_template in tokenizer_config.json nor a "
            "chat_template.jinja), so chat messages cannot be turned into a prompt: pass chat_template=..., or "
            "send a plain prompt (LLM.generate / POST /v1/completions)"
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequestError('messages must be a list of {"role": ..., "content": ...} dicts')
    for i, message in enumerate(messages):
        if isinstance(message.get("content"), (bytes, bytearray)):  # a template would render it as "b'...'"
            raise InvalidRequestError(f"messages[{i}]['content'] is bytes: decode it to str first")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template error (raise_exception, undefined key) is the caller's
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from None
    return encode_text(tokenizer, text, add_special_tokens, what="the chat messages")


def conversation_chars(messages: Conversation) -> int:
    """The characters of the messages' text contents (what a chat template puts into the prompt, at the least)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
