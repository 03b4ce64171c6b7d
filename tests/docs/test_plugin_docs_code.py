"""Code blocks of the plugin documents, run as shown.

- docs/plugins.md: the ``SimulatedEngine`` example runs.
- docs/tutorial-scheduler-plugin.md: the two ways it says to break ``decode_first`` fail with the errors it shows.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from nanovllm_testing.conformance import SchedulerConformance

from nanovllm_core.errors import SchedulerError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HOOKS = ROOT / "examples" / "hooks"
TUTORIAL_SCHEDULER = ROOT / "examples/tutorial/nanovllm-scheduler-decode-first/nanovllm_decode_first/scheduler.py"
UNTITLED_PYTHON = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
TEXT = re.compile(r"^```text\n(.*?)^```$", re.M | re.S)


def module_from(source: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def test_the_simulated_engine_example_of_plugins_md_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    examples = [b for b in UNTITLED_PYTHON.findall((DOCS / "plugins.md").read_text()) if "SimulatedEngine(" in b]
    assert len(examples) == 1, "docs/plugins.md has one SimulatedEngine example"
    monkeypatch.syspath_prepend(str(HOOKS))  # it imports the hook examples, as their tests do
    exec(compile(examples[0], "<plugins.md SimulatedEngine example>", "exec"), {})


def broken_decode_first(replacements: list[tuple[str, str]]) -> type:
    source = TUTORIAL_SCHEDULER.read_text()
    for old, new in replacements:
        assert old in source, f"the tutorial's scheduler no longer contains {old!r}"
        source = source.replace(old, new)
    return module_from(source, "decode_first_broken").DecodeFirstScheduler


def first_scheduler_error(scheduler_cls: type) -> str:
    """Run the kit's simulated scenarios (synchronous) until the engine's step check raises."""
    kit = type("Kit", (SchedulerConformance,), {"scheduler_cls": scheduler_cls})()
    scenarios = [
        kit.test_token_budget_and_max_num_seqs,
        kit.test_long_prompts_in_many_chunks_mixed_with_decodes,
        kit.test_prefix_hits_with_chunked_admission_and_few_blocks,
    ]
    for scenario in scenarios:
        try:
            scenario(async_scheduling=False)
        except SchedulerError as exc:
            return f"SchedulerError: {exc}"
    pytest.fail(f"no scenario made {scheduler_cls.__name__} break a rule")


@pytest.mark.parametrize(
    "replacements",
    [
        pytest.param(  # "Keep the budget that schedule_running returns out of step 2"
            [("        budget = self.schedule_running(out, budget)\n", "        self.schedule_running(out, budget)\n")],
            id="drop-budget-update",
        ),
        pytest.param(  # "admit by hand with the block manager directly ... instead of `schedule_waiting`"
            [(
                "            self.schedule_waiting(out, budget)\n",
                "            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:\n"
                "                n = min(self.waiting[0].num_uncomputed_tokens, budget)\n"
                "                if not self.block_manager.allocate(self.waiting[0], n):\n"
                "                    break\n"
                "                seq = self.waiting.popleft()\n"
                "                self.admit(seq)\n"
                "                out.add(seq, n)\n"
                "                budget -= n\n",
            )],
            id="allocate-instead-of-allocate-chunk",
        ),
    ],
)
def test_the_tutorials_broken_schedulers_fail_as_it_shows(replacements: list[tuple[str, str]]) -> None:
    error = " ".join(first_scheduler_error(broken_decode_first(replacements)).split())
    shown = [" ".join(block.split()) for block in TEXT.findall((DOCS / "tutorial-scheduler-plugin.md").read_text())]
    assert error in shown, f"the tutorial does not show the error this change gives: {error}"
