from naive_attention import NaiveAttentionBackend
from nanovllm_testing.conformance import AttentionBackendConformance


class TestNaiveAttentionBackend(AttentionBackendConformance):
    backend_cls = NaiveAttentionBackend
