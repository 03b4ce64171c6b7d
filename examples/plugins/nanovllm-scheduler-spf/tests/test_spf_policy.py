"""The policy itself: shortest prompt first, aging, options."""

import pytest

pytest.importorskip("nanovllm_scheduler_spf", reason="install the plugin: pip install -e .")

from nanovllm_scheduler_spf import ShortestPromptFirstScheduler  # noqa: E402
from nanovllm_testing.conformance import SchedulerConformance, SimulatedEngine  # noqa: E402

from nanovllm_core import ConfigError  # noqa: E402


def simulate(**kwargs) -> SimulatedEngine:
    kit = type("Kit", (SchedulerConformance,), {"scheduler_cls": ShortestPromptFirstScheduler})()
    return kit.simulate(**kwargs)


def test_the_shortest_waiting_prompt_runs_first() -> None:
    sim = simulate(num_blocks=32, max_num_seqs=1)
    lengths = [60, 30, 8, 3, 45]
    seqs = [sim.add(list(range(n)), 4) for n in lengths]
    sim.run()
    assert [s.num_prompt_tokens for s in sim.finished] == sorted(lengths)
    assert [s.request_id for s in sim.finished] != [s.request_id for s in seqs]
    sim.assert_outputs_exact()


def test_a_long_prompt_overtakes_newer_short_ones_after_aging() -> None:
    sim = simulate(num_blocks=32, max_num_seqs=1, scheduler_options={"aging": 4.0})
    long = sim.add(list(range(40)), 1)
    for _ in range(30):
        sim.add(list(range(8)), 1)
        sim.step()
    assert long.is_finished, "40 - 4 * steps waited drops below 8 within 10 steps"
    sim.run()


def test_without_aging_a_long_prompt_starves() -> None:
    """aging = 0 is plain shortest-prompt-first: the conformance kit's starvation check fails."""
    kit = type(
        "Kit", (SchedulerConformance,),
        {"scheduler_cls": ShortestPromptFirstScheduler, "scheduler_options": {"aging": 0.0}},
    )()
    with pytest.raises(AssertionError, match="starved"):
        kit.test_no_starvation_under_a_stream_of_requests(async_scheduling=False)


@pytest.mark.parametrize("options, message", [({"aging": -1}, "greater than or equal to 0"), ({"agin": 1}, "agin")])
def test_invalid_options_name_the_problem(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        simulate(num_blocks=8, scheduler_options=options)
