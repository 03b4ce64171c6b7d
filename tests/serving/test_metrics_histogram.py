"""The front-end's lock-free latency histograms expose what ``prometheus_client``'s ``Histogram`` would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from nanovllm_core.serving.metrics import ITL_BUCKETS, HistogramCollector, LatencyHistogram

# on a bound, between bounds, below the first, above the last, zero
EDGES = [0.0, 0.0005, 0.001, 0.0025, 0.003, 10.0, 11.0, 1e6]


def exposition(values: list[float]) -> tuple[list[str], list[str]]:
    """(ours, prometheus_client's) text lines for the same observations, without the ``_created`` line."""
    ours = CollectorRegistry()
    histogram = LatencyHistogram("nanovllm:inter_token_latency_seconds", "Time between two outputs.", ITL_BUCKETS)
    ours.register(HistogramCollector("m", [histogram]))
    reference = CollectorRegistry()
    theirs = Histogram(
        "nanovllm:inter_token_latency_seconds", "Time between two outputs.", ["model_name"], buckets=ITL_BUCKETS,
        registry=reference,
    ).labels("m")  # fmt: skip
    for value in values:
        histogram.observe(value)
        theirs.observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    return lines(ours), lines(reference)


def test_edges_land_in_the_same_buckets() -> None:
    ours, theirs = exposition(EDGES)
    assert ours == theirs
    assert 'nanovllm:inter_token_latency_seconds_bucket{le="0.001",model_name="m"} 3.0' in ours


@given(st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), max_size=50))
def test_any_observations_expose_alike(values: list[float]) -> None:
    ours, theirs = exposition(values)
    assert ours[:-1] == theirs[:-1]  # every bucket and the count
    assert abs(float(ours[-1].split()[-1]) - float(theirs[-1].split()[-1])) <= 1e-9 * max(1.0, sum(values))
