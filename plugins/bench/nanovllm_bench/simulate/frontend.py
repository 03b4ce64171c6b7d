"""The serving front-end in a simulation: when a request reaches the engine, and when each token reaches the client.

:class:`FixedFrontEnd` charges every request the calibration's typical times: its intake (a fixed part and a part
per prompt token) before the engine, and the output hand-over after each token. :class:`FrontEndQueue` models
the front-end as what it is, one event loop on one CPU: each request's intake and each step's outputs take their
CPU time in the order they come, so under load a request waits behind the others' work, and tokens wait behind
whole batches of outputs. It needs the front-end's CPU a request and a streamed token (``request_timeline.py
--cpu-requests``, in the calibration as ``cpu_ms_per_request`` and ``output_cpu_ms_per_token``).
"""

from __future__ import annotations

from collections import deque
from typing import Any


class FixedFrontEnd:
    """Every request's intake and every token's hand-over take the calibration's typical time, whatever the load."""

    def __init__(self, frontend: dict[str, Any]) -> None:
        self.intake_s = frontend.get("intake_ms", 0.0) / 1e3
        self.intake_s_per_token = frontend.get("intake_ms_per_1k_prompt_tokens", 0.0) / 1e6
        self.delivery_s = frontend.get("delivery_ms", 0.0) / 1e3

    def expect(self, token_times: list[float], max_tokens: int) -> None:
        """A request whose tokens' engine read times will be appended to ``token_times``."""

    def admit(self, arrival: float, prompt_tokens: int) -> float:
        """When a request sent at ``arrival`` reaches the engine (requests are admitted in the order they came)."""
        return arrival + self.intake_s + self.intake_s_per_token * prompt_tokens

    def on_read(self, end: float, receivers: list[list[float]]) -> None:
        """The engine read a step (ended at ``end``) whose tokens went to ``receivers``' token times."""

    def delivered(self, token_times: list[float]) -> list[float]:
        """When each of a request's tokens (engine read times) reached the client side of the front-end."""
        return [t + self.delivery_s for t in token_times]


class FrontEndQueue(FixedFrontEnd):
    """One CPU serving, first come first served: each request's intake at its arrival (then the pipe to the engine,
    which takes no front-end CPU), and each step's outputs once they are back from the engine: the step's message,
    a streamed token's CPU each, and a request's remaining CPU (its HTTP request and response around the intake)
    as it finishes.

    The costs: the intake's front-end part is the calibration's intake less its pipe hop; a token's CPU is
    ``output_cpu_ms_per_token``, a step's message ``output_cpu_ms_per_step`` (none if absent); a request's rest is
    ``cpu_ms_per_request`` (the CPU of a request of ``cpu_prompt_tokens`` prompt tokens and one output token,
    measured on an idle server) less its intake and its token; the way back from the engine is the calibration's
    hand-over less a token's CPU."""

    def __init__(self, frontend: dict[str, Any]) -> None:
        super().__init__(frontend)
        hop_s = frontend.get("hop_ms", 0.0) / 1e3
        hop_s_per_token = frontend.get("hop_ms_per_1k_prompt_tokens", 0.0) / 1e6
        self.hop_s, self.hop_s_per_token = hop_s, hop_s_per_token
        self.cpu_intake_s = max(self.intake_s - hop_s, 0.0)
        self.cpu_intake_s_per_token = max(self.intake_s_per_token - hop_s_per_token, 0.0)
        self.token_s = frontend["output_cpu_ms_per_token"] / 1e3
        self.step_s = max(frontend.get("output_cpu_ms_per_step", 0.0), 0.0) / 1e3  # a step's outputs as one message
        probe = frontend["cpu_ms_per_request"] / 1e3
        probe_intake = self.cpu_intake_s + self.cpu_intake_s_per_token * frontend.get("cpu_prompt_tokens", 0)
        self.request_s = max(probe - probe_intake - self.token_s, 0.0)
        self.back_s = max(self.delivery_s - self.token_s, 0.0)
        self.free = 0.0  # when the front-end's CPU is next idle
        self.busy = 0.0  # the CPU seconds served so far
        self.outputs: deque[tuple[float, list[list[float]]]] = deque()  # (back at the front-end, receivers)
        # id of a request's token-times list -> (its delivery times, its output length)
        self.receivers: dict[int, tuple[list[float], int]] = {}

    def expect(self, token_times: list[float], max_tokens: int) -> None:
        self.receivers[id(token_times)] = ([], max_tokens)

    def admit(self, arrival: float, prompt_tokens: int) -> float:
        self.serve_outputs(until=arrival)
        start = max(arrival, self.free)
        cpu = self.cpu_intake_s + self.cpu_intake_s_per_token * prompt_tokens
        self.free = start + cpu
        self.busy += cpu
        return self.free + self.hop_s + self.hop_s_per_token * prompt_tokens

    def on_read(self, end: float, receivers: list[list[float]]) -> None:
        if receivers:
            self.outputs.append((end + self.back_s, receivers))

    def serve_outputs(self, until: float = float("inf")) -> None:
        """Serve the outputs back at the front-end by ``until``, in the order they came back."""
        outputs, token_s, request_s = self.outputs, self.token_s, self.request_s
        while outputs and outputs[0][0] <= until:
            back, receivers = outputs.popleft()
            start = max(back, self.free)
            now = start + self.step_s
            for times in receivers:
                delivered, max_tokens = self.receivers[id(times)]
                now += token_s
                delivered.append(now)
                if len(delivered) == max_tokens:
                    now += request_s
            self.free = now
            self.busy += now - start

    def delivered(self, token_times: list[float]) -> list[float]:
        self.serve_outputs()
        return self.receivers[id(token_times)][0]


def front_end_for(frontend: dict[str, Any]) -> FixedFrontEnd:
    """The queue where the calibration has the front-end's CPU costs, else the fixed times."""
    if "output_cpu_ms_per_token" in frontend and "cpu_ms_per_request" in frontend:
        return FrontEndQueue(frontend)
    return FixedFrontEnd(frontend)
