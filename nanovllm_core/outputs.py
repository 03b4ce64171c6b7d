from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated completion (vLLM's ``CompletionOutput``).

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens``
    or the model's length limit), ``"abort"`` (aborted by the caller), ``"error"`` (the request was
    rejected: see ``RequestOutput.error``) or ``None`` while unfinished.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result of one request, in vLLM's shape."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
