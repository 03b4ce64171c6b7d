"""The examples of docs/plugins.md: shown verbatim, registrable as plugins, and passing the conformance kit.

Each example is a plugin module in ``examples/hooks/`` with a ``test_*.py`` beside it; the test classes are
imported here so that this suite runs them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from nanovllm_testing.scripts import folder_on_sys_path

from nanovllm_core import register_plugin, unregister_plugin
from nanovllm_core.plugins import get_registry

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "examples" / "hooks"
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
BLOCK = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```$', re.M | re.S)

with folder_on_sys_path(HOOKS):  # as pytest would for a test file in examples/hooks, for the imports only
    from test_find_models_command import test_find_models_lists_each_checkpoint  # noqa: F401
    from test_function_tag_tool_parser import TestFunctionTagToolParser  # noqa: F401
    from test_int8_weight_only import TestInt8WeightOnly  # noqa: F401
    from test_llama_model import TestLlamaForCausalLM  # noqa: F401
    from test_naive_attention import TestNaiveAttentionBackend  # noqa: F401
    from test_reasoning_tag_parser import TestReasoningTagParser  # noqa: F401
    from test_serial_scheduler import TestSerialScheduler  # noqa: F401
    from test_simple_block_manager import TestSimpleBlockManager  # noqa: F401


def test_plugins_md_shows_every_example_verbatim() -> None:
    blocks = dict(BLOCK.findall(PLUGINS_DOC.read_text()))
    files = {p.name: p.read_text() for p in HOOKS.glob("*.py")}
    assert set(blocks) == set(files), "each file of examples/hooks is one titled code block of docs/plugins.md"
    for name, body in blocks.items():
        assert body == files[name], f"docs/plugins.md shows a different {name} than examples/hooks/{name}"


@pytest.mark.parametrize(
    "module, kind, name",
    [
        ("serial_scheduler", "scheduler", "serial"),
        ("simple_block_manager", "block_manager", "simple"),
        ("naive_attention", "attention", "naive"),
        ("llama_model", "model", "LlamaForCausalLM"),
        ("function_tag_tool_parser", "tool_parser", "function_tag"),
        ("reasoning_tag_parser", "reasoning_parser", "reasoning_tag"),
        ("find_models_command", "command", "find-models"),
        ("int8_weight_only", "quantization", "int8"),
    ],
)
def test_each_example_registers_as_a_plugin(module: str, kind: str, name: str) -> None:
    plugin = sys.modules[module]  # imported by its test file above
    register_plugin(plugin)
    try:
        registry = get_registry()
        assert not [b for b in registry.broken if b.plugin == module], registry.broken
        assert registry.get(kind, name).plugin == module
    finally:
        unregister_plugin(module)
