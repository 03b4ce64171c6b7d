"""A reasoning parser for models that think inside ``<reasoning>...</reasoning>`` before they answer."""

from nanovllm_core import ThinkTagReasoningParser, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class ReasoningTagParser(ThinkTagReasoningParser):
    start = "<reasoning>"
    end = "</reasoning>"
    opens_in_prompt = False  # True if the chat template writes the opening tag itself


@hookimpl
def nanovllm_register_reasoning_parsers(register):
    register("reasoning_tag", ReasoningTagParser)
