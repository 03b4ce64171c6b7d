"""``nanovllm bench serve``'s client and the garbage collector: a collection stops the client's event loop, and
every stream it reads meanwhile looks slower. A client process freezes the heap it starts with (a forked client
holds its parent's: torch's modules, every request of the workload; ``nanovllm_core.gc_heap``), so that a full
collection during the run walks the run's own objects only, and each run reports its clients' longest
collection."""

from __future__ import annotations

import gc
import time

import pytest
from nanovllm_bench.serve import ClientShare, RequestResult, _client_process, combined_summary


@pytest.fixture
def collector_restored():
    """The collector as it was: this process's heap unfrozen, its thresholds back."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


class Connection:
    """A client process's end of its pipe, in this process: the start time it is sent, and what it sends."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.frozen_when_ready = -1

    def send(self, value: object) -> None:
        if value == "ready":
            self.frozen_when_ready = gc.get_freeze_count()
        self.sent.append(value)

    def recv(self) -> float:
        return time.monotonic()

    def close(self) -> None:
        pass


def test_a_client_process_freezes_its_heap_before_it_says_ready(collector_restored) -> None:
    gc.unfreeze()
    connection = Connection()
    _client_process(connection, ("http://127.0.0.1:9/v1/completions", {}, [], 1.0, None, 0, None))
    assert connection.sent[0] == "ready" and connection.frozen_when_ready > 0
    share = connection.sent[1]
    assert isinstance(share, ClientShare) and share.results == []


def test_a_share_records_its_longest_collection_during_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from nanovllm_bench import serve

    async def send_that_collects(session, url, body, headers) -> RequestResult:
        gc.collect()  # as if the run's allocations had called for a full collection
        return RequestResult(ok=True, prompt_tokens=len(body["prompt"]), output_tokens=1)

    monkeypatch.setattr(serve, "send", send_that_collects)
    share = asyncio.run(serve.send_share("http://127.0.0.1:9/v1/completions", {}, [{"prompt": [1, 2]}], 1.0, None, 0))
    assert [r.prompt_tokens for r in share.results] == [2] and share.longest_gc_pause > 0.0


def test_the_run_reports_its_clients_longest_collection() -> None:
    result = RequestResult(ok=True, prompt_tokens=4, output_tokens=2, ttft=0.01, latency=0.02, itl=[0.01])
    shares = [
        ClientShare([result], 0.0, 1.0, [0.001], 0.002),
        ClientShare([result], 0.0, 1.0, [0.001], 0.03),
        ClientShare([result], 0.0, 1.0, [0.001]),
    ]
    summary = combined_summary(shares, [[0], [1], [2]])
    assert summary["max_client_gc_pause_ms"] == 30.0 and summary["client_processes"] == 3
