"""Beam search on top of ``LLM.generate`` (vLLM's ``LLM.beam_search``): each step extends every live beam by one
token, with ``2 * beam_width`` candidates from the logprobs, keeps the best ``beam_width`` per prompt by
length-normalised log-probability, and sets aside beams that end in EOS. The beams' common prefixes come from
the prefix cache when it is on (``enable_prefix_caching``), so a step computes only the new token's KV."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # candidates per beam: 2 * beam_width logprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names: ``beam_width`` beams per prompt (1 to ``MAX_BEAM_WIDTH``), at most ``max_tokens`` new
    tokens each; a beam that samples an EOS id is complete (unless ``ignore_eos``); beams are ranked by
    ``cum_logprob / len(tokens) ** length_penalty`` (prompt included, a final EOS not). ``temperature`` scales
    nothing the ranking reads (the logprobs are the model's) and is kept for vLLM's signature."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(
                f"BeamSearchParams.beam_width={self.beam_width!r} is invalid: allowed an integer from 1 to "
                f"{MAX_BEAM_WIDTH} (each beam draws 2 * beam_width candidates from at most {MAX_LOGPROBS} logprobs)"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"BeamSearchParams.max_tokens={self.max_tokens!r} is invalid: an integer >= 1")


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: ``tokens`` are the prompt's and the generated ones (a final EOS only with
    ``include_stop_str_in_output``), ``text`` their decoded text, ``logprobs`` one dict a generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: the cumulative logprob over the length (a final EOS not counted)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length**length_penalty)


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[Any]],
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
    decode: Callable[[list[int]], str] | None,
) -> list[BeamSearchOutput]:
    """Beam search of every prompt (token ids) through ``generate(prompts, sampling_params)``."""
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos_token_ids, params.length_penalty)

    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        outputs = generate([beam.tokens for beam in beams], step)
        at = 0
        for i, group in enumerate(live):
            candidates = []
            for beam, output in zip(group, outputs[at : at + len(group)]):
                completion = output.outputs[0]
                if completion.finish_reason == "error" or not completion.logprobs:
                    raise InvalidRequestError(f"beam search step failed: {getattr(output, 'error', None)}")
                position = completion.logprobs[0]
                for token_id, entry in position.items():
                    cum_logprob = beam.cum_logprob + entry.logprob
                    if token_id in eos_token_ids and not params.ignore_eos:  # complete; the EOS shown only if asked
                        tokens = beam.tokens + [token_id] if params.include_stop_str_in_output else beam.tokens
                        done[i].append(
                            BeamSearchSequence(tokens, beam.logprobs + [position], cum_logprob, None, "stop", token_id)
                        )
                    else:
                        candidates.append(BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [position],
                                                             cum_logprob))  # fmt: skip
            at += len(group)
            live[i] = sorted(candidates, key=key, reverse=True)[: params.beam_width]
    results = []
    for i, group in enumerate(live):
        for beam in group:
            beam.finish_reason = "length"
        best = sorted(done[i] + group, key=key, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens) if decode is not None else None  # prompt included, as vLLM's
        results.append(BeamSearchOutput(best))
    return results
