from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal, get_args

from nanovllm_core.errors import InvalidRequestError

OutputKind = Literal["final", "delta", "cumulative"]


class RequestOutputKind(str, Enum):
    """vLLM's names for ``output_kind``: ``SamplingParams(output_kind=RequestOutputKind.DELTA)`` is
    ``output_kind="delta"``. ``SamplingParams`` stores the string; a member compares equal to it."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final"

@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint every output of the request satisfies (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (an EBNF/Lark grammar, as the backend reads it) or ``json_object=True`` (any JSON object).

    The engine's structured-output backend (``[plugins] structured_output_backend``) compiles it once per distinct
    constraint, off the engine loop, and masks the tokens that would break it before every sampling step. An
    invalid constraint is an :class:`InvalidRequestError` when the request is added. ``disable_any_whitespace``:
    no optional whitespace in JSON (compact output), where the backend supports it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar or json_object=True; "
                + (f"got {', '.join(given)}" if given else "got none")
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError("StructuredOutputsParams.json is a JSON schema: a dict or its JSON text")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("StructuredOutputsParams.json is a JSON schema: an object (or true/false)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"StructuredOutputsParams.{name} is a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):  # fmt: skip
            raise InvalidRequestError("StructuredOutputsParams.choice is a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise InvalidRequestError("StructuredOutputsParams.json_object is True or False")

    @property
    def kind(self) -> str:
        """Which constraint: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a schema as compact JSON, choices as a JSON list): the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            # key order kept: a backend generates properties in the schema's order ("reasoning" before "answer")
            return json.dumps(json.loads(value) if isinstance(value, str) else value)
        if self.kind == "choice":
            return json.dumps(list(value))
        if self.kind == "json_object":
            return ""
        return value


KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The kinds of constraint :class:`StructuredOutputsParams` carries, as backends name them."""

MAX_LOGPROBS = 20
MAX_N = 128


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_int(t) and t >= 0 for t in value)


def _is_number(value: object) -> bool:
    """A finite int or float, not a bool (an infinity would pass one-sided range checks such as ``>= 0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def with_priority(params: SamplingParams | None, priority: int | None) -> SamplingParams | None:
    """``params`` with ``priority`` set (vLLM's ``priority=`` argument of ``add_request``/``generate``), or
    ``params`` unchanged when ``priority`` is None; ``SamplingParams`` validates it."""
    if priority is None:
        return params
    return replace(params if params is not None else SamplingParams(), priority=priority)


@dataclass
class SamplingParams:
    """How to sample one request, with vLLM's names.

    ``temperature=0`` is greedy decoding; ``top_k=-1`` (or 0), ``top_p=1`` and ``min_p=0`` turn the
    corresponding filter off. ``stop`` strings are matched on the detokenized output and are not part
    of the returned text unless ``include_stop_str_in_output``; ``stop_token_ids`` end generation on those
    tokens (kept in ``token_ids``). ``seed`` makes sampling of this request reproducible whatever else is in
    the batch.

    ``n`` parallel samples share the prompt. ``logprobs=k`` returns, for each generated token, its own logprob
    and the ``k`` most likely tokens' (``prompt_logprobs=k``: the same for each prompt token after the first);
    they are ``log_softmax`` of the model's raw logits, before penalties, temperature and filters (vLLM's
    default). ``presence_penalty`` / ``frequency_penalty`` subtract from the logits of tokens already generated
    (once / per occurrence); ``repetition_penalty`` divides positive and multiplies negative logits of tokens
    seen in the prompt or the output (1 is off). ``priority``: lower runs first under a priority policy.
    ``truncate_prompt_tokens=k`` keeps only the prompt's last ``k`` tokens (vLLM's: a long prompt then fits).
    ``min_tokens=k``: no EOS or stop token before ``k`` tokens are out (their logits are masked), and no stop string
    ends the output before it has ``k`` tokens (vLLM's). ``logit_bias`` (token id -> bias, clamped to [-100, 100],
    OpenAI's) is added to those tokens' logits before sampling; ``allowed_token_ids`` restricts sampling to those
    tokens. ``bad_words`` are never generated (vLLM's): each word, with and without a leading space, as the
    tokenizer writes it; its last token is masked whenever the output so far ends with the tokens before it.
    Like the penalties, these shape what is sampled, not the logprobs reported. ``embed=True`` (``LLM.embed``
    sets it): the output's ``embedding`` is the last prompt token's final hidden state, L2-normalised
    (last-token pooling, as Qwen3-Embedding's), with ``n=1``. ``structured_outputs``: a
    :class:`StructuredOutputsParams` every sample's output satisfies (JSON schema, regex, choice, grammar).
    ``output_kind``: what ``LLMEngine.step`` returns for the request: only the final output, every step's new
    tokens (``delta``) or everything so far (``cumulative``); vLLM's :class:`RequestOutputKind` members
    (``FINAL_ONLY``, ``DELTA``, ``CUMULATIVE``) are accepted too. ``detokenize=False``: outputs carry token ids only
    (``text`` stays empty), for callers that decode the text themselves, as the server's front-end does.
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
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    priority: int = 0
    output_kind: OutputKind | RequestOutputKind = "final"
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    embed: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # bad_words as token ids (for_engine tokenizes them; vLLM's _bad_words_token_ids)
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False)
    # The token ids min_tokens holds back: stop_token_ids, plus the engine's EOS ids unless ignore_eos
    # (for_engine adds those; vLLM's all_stop_token_ids)
    all_stop_token_ids: frozenset[int] = field(init=False, repr=False)
    # Whether sampling changes some logits of this request (min_tokens, logit_bias, allowed_token_ids)
    adjusts_logits: bool = field(init=False, repr=False)
    # Whether sampling reads the tokens so far (a penalty is on): the engine must then have the sequence's real
    # tokens on the host before each of its steps is sampled. Derived once, like stop_strings: the sampler reads
    # it for every row of every step, and a property would cost several times a plain attribute there.
    needs_output_token_ids: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: allowed {allowed}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer from 1 to {MAX_N}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a finite number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or -1 / 0 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a finite number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a finite number in [-2, 2] (0 is off)")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "a finite number > 0 (1 is off)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "an integer with 0 <= seed < 2**64, or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer from 0 to {MAX_LOGPROBS} (top tokens besides the chosen one)")
        if not _is_int(self.priority):
            raise bad("priority", "an integer (lower is scheduled first)")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", "None or an integer >= 1 (the prompt's last tokens kept)")
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = self.output_kind.value  # one type downstream: comparisons and pickling see a str
        if not isinstance(self.output_kind, str) or self.output_kind not in get_args(OutputKind):
            raise bad(
                "output_kind",
                " or ".join(repr(k) for k in get_args(OutputKind))
                + " (or RequestOutputKind.FINAL_ONLY, DELTA or CUMULATIVE)",
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "True or False")
        if isinstance(self.stop, str) and self.stop:
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise bad("stop", "a non-empty string, a list of non-empty strings, or None")
        if not isinstance(self.embed, bool) or (self.embed and self.n != 1):
            raise bad("embed", "True or False (True with n=1: one embedding a prompt)")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "True or False")
        if not self.detokenize and self.stop_strings:
            raise bad("detokenize", "True when stop strings are given (they are matched on the text)")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not _is_token_ids(self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.top_k == 0:
            self.top_k = -1
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer from 0 to max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(b) for t, b in self.logit_bias.items()
            ):
                raise bad("logit_bias", "None or a dict of non-negative token ids to finite numbers")
            self.logit_bias = {t: min(max(float(b), -100.0), 100.0) for t, b in self.logit_bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None and not (allowed and _is_token_ids(allowed)):
            raise bad("allowed_token_ids", "None or a non-empty list of non-negative token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w for w in self.bad_words)
        ):
            raise bad("bad_words", "None or a list of non-empty strings")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "None or a StructuredOutputsParams")
            if self.embed:
                raise bad("structured_outputs", "None with embed=True (an embedding samples nothing)")
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        self.bad_words_token_ids = []
        self.adjusts_logits = bool(self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words)
        # bad words of several tokens are matched against the output so far
        self.needs_output_token_ids = (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
            or bool(self.bad_words)
        )

    def for_engine(
        self,
        eos_token_ids: frozenset[int] | set[int],
        vocab_size: int | None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> SamplingParams:
        """These parameters as one request of an engine with these EOS ids, vocabulary and tokenizer (``encode``,
        without special tokens): token ids outside the vocabulary are an InvalidRequestError; with ``min_tokens``
        a copy whose ``all_stop_token_ids`` holds the EOS ids too (unless ``ignore_eos``); with ``bad_words`` a copy
        that holds their token ids; else ``self``."""
        if vocab_size is not None:
            token_lists = (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()))
            for name, ids in token_lists:
                bad = sorted(t for t in ids if t >= vocab_size)
                if bad:
                    raise InvalidRequestError(
                        f"SamplingParams.{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
                    )
        if self.min_tokens and self.allowed_token_ids:
            stops = self.all_stop_token_ids | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))
            if stops.issuperset(self.allowed_token_ids):
                raise InvalidRequestError(
                    "SamplingParams.allowed_token_ids holds only EOS and stop tokens, which min_tokens="
                    f"{self.min_tokens} masks: nothing could be sampled"
                )
        holds_eos = not self.min_tokens or self.ignore_eos or eos_token_ids <= self.all_stop_token_ids
        if holds_eos and not self.bad_words:
            return self
        params = replace(self)
        if not holds_eos:
            params.all_stop_token_ids = self.all_stop_token_ids | frozenset(eos_token_ids)
        if self.bad_words:
            if encode is None:
                raise InvalidRequestError("SamplingParams.bad_words needs an engine with a tokenizer")
            for word in self.bad_words:
                for text in (word, " " + word.lstrip(" ")):
                    ids = list(encode(text))
                    if ids and ids not in params.bad_words_token_ids:
                        params.bad_words_token_ids.append(ids)
        return params
