from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm_core.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to sample one request, with vLLM's names.

    ``temperature=0`` is greedy decoding; ``top_k=-1`` (or 0), ``top_p=1`` and ``min_p=0`` turn the
    corresponding filter off. ``stop`` strings are matched on the detokenized output and are not part
    of the returned text; ``stop_token_ids`` end generation on those tokens (kept in ``token_ids``).
    ``seed`` makes sampling of this request reproducible whatever else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: allowed {allowed}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or -1 / 0 to disable")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "an integer or None")
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise bad("stop", "a non-empty string, a list of non-empty strings, or None")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
