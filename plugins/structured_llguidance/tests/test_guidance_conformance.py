"""The core's structured-output conformance kit run against the ``guidance`` backend."""

from nanovllm_structured_llguidance import GuidanceBackend
from nanovllm_testing.conformance import StructuredOutputConformance


class TestGuidanceBackend(StructuredOutputConformance):
    backend_cls = GuidanceBackend
