"""The core's structured-output conformance kit run against the ``xgrammar`` backend."""

from nanovllm_structured_xgrammar import XgrammarBackend
from nanovllm_testing.conformance import StructuredOutputConformance


class TestXgrammarBackend(StructuredOutputConformance):
    backend_cls = XgrammarBackend
