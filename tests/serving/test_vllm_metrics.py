"""``/metrics`` carries vLLM's series names (``vllm:...``) beside ours, with the same values, so that a vLLM dashboard
works unchanged: scraped from a real server after real requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}

VLLM_SERIES = {
    "vllm:num_requests_running": "nanovllm:num_requests_running",
    "vllm:num_requests_waiting": "nanovllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc": "nanovllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total": "nanovllm:prompt_tokens_total",
    "vllm:generation_tokens_total": "nanovllm:generation_tokens_total",
    "vllm:num_preemptions_total": "nanovllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total": "nanovllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "nanovllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_count": "nanovllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "nanovllm:time_to_first_token_seconds_sum",
    "vllm:inter_token_latency_seconds_count": "nanovllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count": "nanovllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "nanovllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count": "nanovllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count": "nanovllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count": "nanovllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count": "nanovllm:request_inference_time_seconds_count",
    "vllm:request_inference_time_seconds_sum": "nanovllm:request_inference_time_seconds_sum",
}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_name(samples: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


def test_vllm_names_carry_the_same_values_as_ours(server) -> None:
    for i in range(3):  # streamed, so that inter-token latencies are observed
        with httpx.stream(
            "POST", server.url + "/v1/completions", headers=HEADERS, timeout=60,
            json={"model": MODEL, "prompt": f"vllm metrics {i}", "max_tokens": 4, "stream": True, "ignore_eos": True},
        ) as response:  # fmt: skip
            assert response.status_code == 200
            body = "".join(response.iter_text())
        assert body.rstrip().endswith("data: [DONE]")
    server.wait_idle()
    samples = scrape(server.url)
    for vllm_name, ours in VLLM_SERIES.items():
        theirs = by_name(samples, vllm_name)
        assert theirs, f"{vllm_name} is missing from /metrics"
        assert theirs == by_name(samples, ours), vllm_name
        assert all(dict(labels)["model_name"] == MODEL for labels in theirs)
    assert by_name(samples, "vllm:generation_tokens_total")[(("model_name", MODEL),)] >= 12
    assert by_name(samples, "vllm:time_per_output_token_seconds_count")[(("model_name", MODEL),)] >= 9
    # every bucket of a histogram, under both names
    assert by_name(samples, "vllm:time_to_first_token_seconds_bucket") == by_name(
        samples, "nanovllm:time_to_first_token_seconds_bucket"
    )
    finished = by_name(samples, "vllm:request_success_total")
    assert finished == by_name(samples, "nanovllm:request_success_total")
    assert finished[(("finished_reason", "length"), ("model_name", MODEL))] >= 3
