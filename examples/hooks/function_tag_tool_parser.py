"""A tool-call parser for replies that write each call as ``<function=NAME>{"arg": ...}</function>``."""

import json

from nanovllm_core import ParsedToolCall, TaggedToolParser, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class FunctionTagToolParser(TaggedToolParser):
    start = "<function="
    end = "</function>"

    def parse_call(self, body: str) -> ParsedToolCall | None:
        name, _, arguments = body.partition(">")  # body: NAME>{...}
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not name or not isinstance(parsed, dict):
            return None  # not a call: the block stays in the content as written
        return ParsedToolCall(name, json.dumps(parsed, ensure_ascii=False))


@hookimpl
def nanovllm_register_tool_parsers(register):
    register("function_tag", FunctionTagToolParser)
