"""The nanovllm conformance kit, run against this plugin's scheduler."""

import pytest

pytest.importorskip("nanovllm_scheduler_spf", reason="install the plugin: pip install -e .")

from nanovllm_scheduler_spf import ShortestPromptFirstScheduler  # noqa: E402
from nanovllm_testing.conformance import SchedulerConformance  # noqa: E402


class TestShortestPromptFirst(SchedulerConformance):
    scheduler_cls = ShortestPromptFirstScheduler
