from naive_attention import NaiveAttentionBackend

from nanovllm_core.testing.conformance import AttentionBackendConformance


class TestNaiveAttentionBackend(AttentionBackendConformance):
    backend_cls = NaiveAttentionBackend
