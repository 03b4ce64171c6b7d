"""What the engine returns for a request, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""token id -> :class:`Logprob` at one position: the sampled (or prompt) token and the top ``logprobs``."""


@dataclass
class CompletionOutput:
    """One generated completion (vLLM's ``CompletionOutput``).

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens``
    or the model's length limit), ``"abort"`` (aborted by the caller), ``"error"`` (the request was
    rejected: see ``RequestOutput.error``) or ``None`` while unfinished. With ``output_kind="delta"``,
    ``text``, ``token_ids`` and ``logprobs`` hold only what is new since the request's previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request went through each stage (``time.monotonic()`` seconds) and its token counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    prompt_scheduled_time: float | None = None  # the step that computes the prompt's last token was scheduled

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one request, in vLLM's shape: one :class:`CompletionOutput` per sample (``n``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.embed: the prompt's L2-normalised last hidden state
