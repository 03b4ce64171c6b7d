"""Plugin options, checked against a class's ``Options`` model or its constructor: errors that name the option
and list the accepted ones (that the engine checks them before any weights load: engine/test_engine_config.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from nanovllm_scheduler_fifo import FifoScheduler, PrefixCachingBlockManager

from nanovllm_core import AttentionBackend, ConfigError
from nanovllm_core.engine.options import instantiate, validate_options

SPF = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "nanovllm-scheduler-spf"


@pytest.fixture
def spf_class(monkeypatch: pytest.MonkeyPatch) -> type:
    """The example's scheduler class (it declares a pydantic ``Options`` model), imported from its folder."""
    monkeypatch.syspath_prepend(str(SPF))
    from nanovllm_scheduler_spf.scheduler import ShortestPromptFirstScheduler

    yield ShortestPromptFirstScheduler
    for name in [m for m in sys.modules if m.startswith("nanovllm_scheduler_spf")]:
        del sys.modules[name]


class PlainBackend(AttentionBackend):
    """An attention backend that keeps the core's constructor: what the engine passes it is not an option."""

    def forward(self, q, k, v, kv_cache, metadata):  # pragma: no cover - never run
        raise AssertionError("not called")


class Windowed(FifoScheduler):
    """A plugin without an ``Options`` model whose constructor takes one option and passes the rest on."""

    def __init__(self, config: Any, block_manager: Any, *, window: int = 4, **options: Any) -> None:
        super().__init__(config, block_manager, **options)
        self.window = window


# --- classes without an Options model: names checked against the constructor -----------------------


@pytest.mark.parametrize(
    "kind, cls", [("scheduler", FifoScheduler), ("block_manager", PrefixCachingBlockManager),
                  ("attention", PlainBackend)],
)
def test_a_class_without_options_lists_none(kind: str, cls: type) -> None:
    with pytest.raises(ConfigError) as info:
        validate_options(kind, cls, {"colour": "red"})
    assert str(info.value) == (
        f"plugins.{kind}_options ['colour'] not accepted by {cls.__name__}; "
        "accepted options: none (it takes no options)"
    )
    assert validate_options(kind, cls, {}) == {}


def test_constructor_options_are_listed_and_passed_on() -> None:
    expected = r"\['windw'\] not accepted by Windowed; accepted options: window \(default 4\)$"
    with pytest.raises(ConfigError, match=expected):
        validate_options("scheduler", Windowed, {"windw": 8})
    assert validate_options("scheduler", Windowed, {"window": 8}) == {"window": 8}


def test_what_the_engine_passes_is_not_an_option() -> None:
    with pytest.raises(ConfigError, match=r"\['enable_prefix_caching'\] not accepted"):
        validate_options("block_manager", PrefixCachingBlockManager, {"enable_prefix_caching": False})


# --- classes with an Options model: pydantic errors formatted like the engine config's -------------


def test_an_invalid_value_names_the_option_without_pydantic_urls(spf_class: type) -> None:
    with pytest.raises(ConfigError) as info:
        validate_options("scheduler", spf_class, {"aging": -1})
    assert str(info.value) == (
        "invalid plugins.scheduler_options for ShortestPromptFirstScheduler:\n"
        "  plugins.scheduler_options.aging: Input should be greater than or equal to 0 (got -1)\n"
        "accepted options: aging (default 1.0)"
    )


def test_an_unknown_option_suggests_the_close_one(spf_class: type) -> None:
    with pytest.raises(ConfigError) as info:
        validate_options("scheduler", spf_class, {"agin": 2})
    message = str(info.value)
    assert "plugins.scheduler_options.agin: unknown option; did you mean 'aging'?" in message
    assert message.endswith("accepted options: aging (default 1.0)")
    assert "http" not in message and "For further information" not in message


def test_options_are_strict_and_come_back_with_defaults(spf_class: type) -> None:
    with pytest.raises(ConfigError, match="aging: Input should be a valid number; strings are not converted"):
        validate_options("scheduler", spf_class, {"aging": "2"})
    assert validate_options("scheduler", spf_class, {"aging": 2}) == {"aging": 2.0}
    assert validate_options("scheduler", spf_class, {}) == {"aging": 1.0}


def test_instantiate_passes_the_validated_options(spf_class: type) -> None:
    from nanovllm_core import EngineConfig

    config = EngineConfig(model="unused", max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = instantiate("scheduler", spf_class, {"aging": 3}, config, PrefixCachingBlockManager(8, 16))
    assert scheduler.aging == 3.0
    with pytest.raises(ConfigError, match="accepted options: aging"):
        instantiate("scheduler", spf_class, {"speed": 1}, config, PrefixCachingBlockManager(8, 16))
