"""``nanovllm bench serve`` sends each request when it is due, counted from the start: a client event loop held up
for a while sends the requests that fell due meanwhile late, and the ones after them on time (the arrivals stay
the Poisson process ``--request-rate`` names, the one ``nanovllm simulate`` replays), and the run reports how late
its sends went out."""

from __future__ import annotations

import asyncio
import time

import pytest
from nanovllm_bench.serve import ClientShare, RequestResult, combined_summary
from nanovllm_bench.simulate.run import poisson_arrivals


def test_a_held_up_loop_delays_the_sends_then_due_not_the_ones_after(monkeypatch) -> None:
    from nanovllm_bench import serve

    sent: list[float] = []

    async def send_holding_the_loop(session, url, body, headers) -> RequestResult:
        sent.append(time.monotonic())
        if len(sent) == 1:
            time.sleep(0.15)  # the first request holds the event loop (as a long collection or a burst of chunks)
        return RequestResult(ok=True, prompt_tokens=len(body["prompt"]), output_tokens=1)

    monkeypatch.setattr(serve, "send", send_holding_the_loop)
    rate, n = 40.0, 12
    share = asyncio.run(serve.send_share("http://127.0.0.1:9/v1/completions", {}, [{"prompt": [1]}] * n, rate, None, 5))
    due = poisson_arrivals(n, rate, 5)  # the times nanovllm simulate gives the same requests
    assert len(share.send_lateness) == n and len(sent) == n
    offsets = [t - sent[0] for t in sent]
    for i in range(1, n):
        if due[i] > 0.15 + 0.05:  # fell due well after the hold: sent on time, not shifted by it
            assert offsets[i] == pytest.approx(due[i], abs=0.03), (i, offsets, due)
            assert share.send_lateness[i] < 0.03
        elif due[i] < 0.1:  # fell due during the hold: sent once it ended, and counted late
            assert offsets[i] >= 0.14 and share.send_lateness[i] > 0.04
    assert any(d > 0.2 for d in due) and any(0 < d < 0.1 for d in due[1:])  # both kinds occur with this seed


def test_the_summary_reports_how_late_the_sends_went_out() -> None:
    result = RequestResult(ok=True, prompt_tokens=4, output_tokens=2, ttft=0.01, latency=0.02, itl=[0.01])
    shares = [ClientShare([result], 0.0, 1.0, [0.001], 0.0, [0.0, 0.004]), ClientShare([result], 0.0, 1.0, [0.001])]
    summary = combined_summary(shares, [[0], [1]])
    assert summary["mean_send_lateness_ms"] == pytest.approx(2.0) and summary["max_send_lateness_ms"] == 4.0
