"""Where each served request's time went: its stamps from the HTTP request to the last output, front-end and
engine side by side, as ``--request-timeline FILE`` writes them (one JSON object a line) and the metrics observe
them.

Every stamp is ``time.monotonic()`` seconds, one clock for every process of a machine, so the engine's stamps
(taken in the engine process) and the front-end's line up. ``nanovllm simulate --calibrate --request-timelines``
fits the simulator's front-end model from these files.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nanovllm_core.outputs import RequestMetrics

STAGES = (
    "received", "validated", "handed", "engine_arrival", "first_scheduled", "prompt_scheduled", "first_token",
    "first_token_delivered", "finished", "delivered",
)  # fmt: skip
"""The stamps of a :class:`RequestTimeline`, in the order a request passes them."""


@dataclass(frozen=True)
class RequestTimeline:
    """One request's stamps (``time.monotonic()`` seconds; None: the request never got there).

    ``received``: the server got the HTTP request (``arrival_time`` given to ``AsyncLLM.add_request``; without
    one, when ``add_request`` was called). ``validated``: ``add_request`` was called (a server has checked the
    body and tokenized the prompt by then). ``handed``: sent to the engine (a text prompt given to
    ``add_request`` is tokenized before). ``engine_arrival``, ``first_scheduled``,
    ``prompt_scheduled`` (the step computing the prompt's last token was scheduled), ``first_token`` (read by the
    engine) and ``finished``: the engine's :class:`~nanovllm_core.outputs.RequestMetrics`.
    ``first_token_delivered`` and ``delivered``: the front-end had the first and the last output.
    """

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    received: float
    validated: float
    handed: float
    engine_arrival: float
    first_scheduled: float | None
    prompt_scheduled: float | None
    first_token: float | None
    first_token_delivered: float | None
    finished: float | None
    delivered: float

    @classmethod
    def of(cls, request_id: str, frontend: dict[str, Any], metrics: RequestMetrics) -> RequestTimeline:
        """From the front-end's stamps (``RequestStream.stamps``) and the engine's metrics."""
        return cls(
            request_id, metrics.num_prompt_tokens, metrics.num_cached_tokens, metrics.num_generation_tokens,
            received=frontend["received"], validated=frontend["validated"], handed=frontend["handed"],
            engine_arrival=metrics.arrival_time, first_scheduled=metrics.first_scheduled_time,
            prompt_scheduled=metrics.prompt_scheduled_time, first_token=metrics.first_token_time,
            first_token_delivered=frontend["first_token_delivered"], finished=metrics.finished_time,
            delivered=frontend["delivered"],
        )  # fmt: skip


class RequestTimelineLog:
    """``--request-timeline FILE``: a JSON line for every finished request, written as it finishes (line
    buffered, so that a server stopped any way leaves whole lines). The first line names the clock."""

    def __init__(self, path: str | Path) -> None:
        self._file: IO[str] | None = open(path, "w", buffering=1)
        header = {"clock": "time.monotonic", "monotonic": time.monotonic(), "unix": time.time(), "stages": STAGES}
        self._file.write(json.dumps(header) + "\n")

    def write(self, timeline: RequestTimeline) -> None:
        if self._file is not None:
            self._file.write(json.dumps(dataclasses.asdict(timeline)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
