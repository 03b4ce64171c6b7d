from nanovllm_testing.conformance import ReasoningParserConformance
from reasoning_tag_parser import ReasoningTagParser


class TestReasoningTagParser(ReasoningParserConformance):
    parser_cls = ReasoningTagParser
    replies = ["<reasoning>2 + 2 is 4.</reasoning>It is 4.", "It is 4.", "<reasoning>still thinking"]
    expected = [("2 + 2 is 4.", "It is 4."), (None, "It is 4."), ("still thinking", "")]
