from function_tag_tool_parser import FunctionTagToolParser
from nanovllm_testing.conformance import ToolParserConformance


class TestFunctionTagToolParser(ToolParserConformance):
    parser_cls = FunctionTagToolParser
    replies = [
        'Checking. <function=get_weather>{"city": "Bern"}</function>',
        '<function=a>{}</function><function=b>{"n": 1}</function> done',
    ]

    def test_what_a_reply_becomes(self) -> None:
        parsed = FunctionTagToolParser().parse(self.replies[0])
        assert parsed.content == "Checking. "
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Bern"}')]
