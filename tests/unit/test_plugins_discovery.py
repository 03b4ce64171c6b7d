"""Plugin discovery through entry points, API versions, and the errors a plugin author hits.

Each test builds fake distributions on the fly: a ``*.dist-info`` folder with ``METADATA`` and
``entry_points.txt`` plus the plugin module, in a temporary folder put on ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import textwrap
from pathlib import Path

import pytest

import nanovllm_core
from nanovllm_core import PluginConflictError, UnknownPluginError
from nanovllm_core.plugins import BrokenPlugin, PluginRegistry, api_supported, build_registry

_ids = itertools.count()

VALID_SCHEDULER = """
    from nanovllm_core import hookimpl
    from nanovllm_scheduler_fifo import FifoScheduler

    NANOVLLM_PLUGIN_API = ">=2,<3"

    class Renamed(FifoScheduler):
        pass

    @hookimpl
    def nanovllm_register_schedulers(register):
        register("{name}", Renamed)
"""


class FakeSite:
    """A folder on ``sys.path`` holding fake distributions and their plugin modules (unique names per test)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prefix = f"fake_plugin_{next(_ids)}_"

    def module(self, name: str, source: str, declare_api: bool = True) -> str:
        """A module with ``source``; unless it declares its plugin API (or ``declare_api`` is false), the
        current API is declared at its end (so line numbers in ``source`` stay as written)."""
        full = self.prefix + name
        source = textwrap.dedent(source)
        if declare_api and "NANOVLLM_PLUGIN_API" not in source:
            source += f"\nNANOVLLM_PLUGIN_API = {nanovllm_core.PLUGIN_API_VERSION}\n"
        (self.root / f"{full}.py").write_text(source)
        return full

    def dist(self, name: str, entry_points: dict[str, str], version: str = "1.0") -> None:
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[nanovllm]\n{lines}")

    def plugin(self, dist: str, source: str, version: str = "1.0", declare_api: bool = True) -> str:
        """One distribution whose single entry point ``<dist>`` loads a module with ``source``."""
        module = self.module(dist.replace("-", "_"), source, declare_api)
        self.dist(dist, {dist: module}, version)
        return module


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSite:
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return FakeSite(tmp_path)


def broken_of(registry: PluginRegistry, plugin: str) -> list[BrokenPlugin]:
    return [b for b in registry.broken if b.plugin == plugin]


def assert_others_still_load(registry: PluginRegistry) -> None:
    """The installed fifo plugin (the only one these tests need) still loads beside the broken ones."""
    assert registry.get("scheduler", "fifo").distribution == "nanovllm-scheduler-fifo"
    assert registry.get("block_manager", "prefix_cache").distribution == "nanovllm-scheduler-fifo"


# --- discovery --------------------------------------------------------------------------------------


def test_a_fake_distribution_is_discovered(site: FakeSite) -> None:
    module = site.plugin("fake-sched", VALID_SCHEDULER.format(name="renamed"), version="2.3")
    registry = build_registry()
    reg = registry.get("scheduler", "renamed")
    assert (reg.plugin, reg.distribution, reg.version, reg.module) == ("fake-sched", "fake-sched", "2.3", module)
    assert not broken_of(registry, "fake-sched")
    assert_others_still_load(registry)


def test_two_distributions_may_use_the_same_entry_point_name(site: FakeSite) -> None:
    site.dist("fake-one", {"plugin": site.module("one", VALID_SCHEDULER.format(name="one"))})
    site.dist("fake-two", {"plugin": site.module("two", VALID_SCHEDULER.format(name="two"))})
    registry = build_registry()
    assert registry.get("scheduler", "one").distribution == "fake-one"
    assert registry.get("scheduler", "two").distribution == "fake-two"
    assert not registry.broken


def test_a_duplicate_name_names_both_distributions(site: FakeSite) -> None:
    site.plugin("fake-one", VALID_SCHEDULER.format(name="same"))
    site.plugin("fake-two", VALID_SCHEDULER.format(name="same"))
    registry = build_registry()  # loading does not fail: only selecting the name does
    with pytest.raises(PluginConflictError, match="two plugins register a scheduler named 'same'") as info:
        registry.get("scheduler", "same")
    assert "fake-one 1.0" in str(info.value) and "fake-two 1.0" in str(info.value)
    assert "Uninstall one of the distributions or rename" in str(info.value)
    assert "same" not in registry.names("scheduler")
    assert sorted(r.distribution for r in registry.all() if r.name == "same") == ["fake-one", "fake-two"]
    assert_others_still_load(registry)


def test_a_name_taken_by_an_installed_plugin_is_a_conflict(site: FakeSite) -> None:
    site.plugin("fake-fifo", VALID_SCHEDULER.format(name="fifo"))
    site.plugin("fake-other", VALID_SCHEDULER.format(name="other"))
    registry = build_registry()
    with pytest.raises(PluginConflictError, match="nanovllm-scheduler-fifo .* fake-fifo|fake-fifo .* nanovllm-sch"):
        registry.get("scheduler", "fifo")
    assert registry.get("scheduler", "other").distribution == "fake-other"  # another name of the kind works
    assert registry.get("block_manager", "prefix_cache").distribution == "nanovllm-scheduler-fifo"


def test_three_registrations_of_one_name_are_all_named(site: FakeSite) -> None:
    for dist in ("fake-a", "fake-b", "fake-c"):
        site.plugin(dist, VALID_SCHEDULER.format(name="trio"))
    registry = build_registry()
    with pytest.raises(PluginConflictError, match="3 plugins register a scheduler named 'trio'") as info:
        registry.get("scheduler", "trio")
    assert all(f"{dist} 1.0" in str(info.value) for dist in ("fake-a", "fake-b", "fake-c"))


# --- plugin API versions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, version, ok",
    [(1, 1, True), (2, 1, False), ("1", 1, True), ("==1", 2, False), (">=1,<2", 1, True), (">=1,<2", 2, False),
     (">= 1, < 3", 2, True), ("!=2", 2, False), (">1", 1, False), ("<=3", 3, True)],
)
def test_api_specifiers(spec: object, version: int, ok: bool) -> None:
    assert api_supported(spec, version) is ok


@pytest.mark.parametrize("spec", ["one", "", ">=1,", "~=1", "1.0", True, None, [1]])
def test_invalid_api_specifiers(spec: object) -> None:
    with pytest.raises(ValueError, match="not a version specifier"):
        api_supported(spec, 1)


@pytest.mark.parametrize("declared", [">=3,<4", "==1"], ids=["newer", "older"])
def test_an_incompatible_plugin_is_broken_and_the_others_load(site: FakeSite, declared: str) -> None:
    source = VALID_SCHEDULER.format(name="other-api").replace('">=2,<3"', repr(declared))
    site.plugin("fake-other-api", source, version="5.0")
    registry = build_registry()
    [broken] = broken_of(registry, "fake-other-api")
    assert (broken.distribution, broken.version) == ("fake-other-api", "5.0")
    assert broken.error == (
        f"incompatible plugin API: the plugin declares NANOVLLM_PLUGIN_API = {declared!r} but nanovllm-core "
        f"{nanovllm_core.__version__} provides plugin API {nanovllm_core.PLUGIN_API_VERSION}; install a release of "
        "the plugin that supports this API, or a nanovllm-core that provides an API the plugin supports"
    )
    assert "other-api" not in registry.names("scheduler")
    with pytest.raises(UnknownPluginError, match="fake-other-api"):
        registry.get("scheduler", "other-api")
    assert_others_still_load(registry)


def test_an_invalid_api_declaration_is_broken(site: FakeSite) -> None:
    site.plugin("fake-badapi", VALID_SCHEDULER.format(name="x").replace('">=2,<3"', '"version one"'))
    [broken] = broken_of(build_registry(), "fake-badapi")
    assert "NANOVLLM_PLUGIN_API = 'version one' is not a version specifier" in broken.error


def test_an_undeclared_api_means_the_current_api(site: FakeSite) -> None:
    source = VALID_SCHEDULER.format(name="undeclared").replace('NANOVLLM_PLUGIN_API = ">=2,<3"', "")
    site.plugin("fake-undeclared", source, declare_api=False)
    registry = build_registry()
    assert registry.get("scheduler", "undeclared").distribution == "fake-undeclared"
    assert not broken_of(registry, "fake-undeclared")


@pytest.mark.parametrize(
    "dist, module",
    [("nanovllm-scheduler-fifo", "nanovllm_scheduler_fifo.plugin"),
     ("nanovllm-attention-flash", "nanovllm_attention_flash.plugin"),
     ("nanovllm-models-qwen3", "nanovllm_models_qwen3.plugin")],
)
def test_in_tree_plugins_declare_the_api(dist: str, module: str) -> None:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")  # the core's unit tests also run without the other plugins
    spec = importlib.import_module(module).NANOVLLM_PLUGIN_API
    assert api_supported(spec, nanovllm_core.PLUGIN_API_VERSION)


# --- registered objects that do not satisfy their interface -----------------------------------------


def test_a_class_that_is_not_a_scheduler(site: FakeSite) -> None:
    site.plugin("fake-notsched", """
        from nanovllm_core import hookimpl
        from nanovllm_scheduler_fifo import FifoScheduler

        class NotAScheduler:
            pass

        @hookimpl
        def nanovllm_register_schedulers(register):
            register("bad", NotAScheduler)
            register("good", type("Good", (FifoScheduler,), {}))
    """)
    registry = build_registry()
    [broken] = broken_of(registry, "fake-notsched")
    assert "registered scheduler 'bad'" in broken.error
    assert "is not a subclass of nanovllm_core.Scheduler" in broken.error
    assert "`class NotAScheduler(nanovllm_core.Scheduler)`" in broken.error
    assert "bad" not in registry.names("scheduler") and "good" in registry.names("scheduler")


def test_a_scheduler_with_unimplemented_methods(site: FakeSite) -> None:
    site.plugin("fake-half", """
        from nanovllm_core import BlockManager, Scheduler, hookimpl

        class NoPolicy(Scheduler):
            def enqueue(self, seq):
                super().enqueue(seq)

        class Half(BlockManager):
            def free(self, seq):
                pass

        @hookimpl
        def nanovllm_register_schedulers(register):
            register("nopolicy", NoPolicy)

        @hookimpl
        def nanovllm_register_block_managers(register):
            register("half", Half)
    """)
    errors = [b.error for b in broken_of(build_registry(), "fake-half")]
    assert any("NoPolicy does not implement schedule (abstract in nanovllm_core.Scheduler)" in e for e in errors)
    assert any(
        "Half does not implement allocate, num_cached_tokens, num_free_blocks (abstract in nanovllm_core.BlockManager)"
        in e for e in errors
    )


@pytest.mark.parametrize(
    "hook, obj, expected",
    [
        ("nanovllm_register_block_managers", "dict", "not a subclass of nanovllm_core.BlockManager"),
        ("nanovllm_register_attention_backends", "Backend(4, 4, 32, 1.0, 16, None, None)",
         "got an instance of Backend; register the class itself"),
        ("nanovllm_register_models", "NoLogits", "lacks compute_logits"),
        ("nanovllm_register_models", "int", "is not a torch.nn.Module"),
        ("nanovllm_register_models", "torch.nn.Linear", "lacks compute_logits, load_weights"),
    ],
)
def test_objects_that_do_not_satisfy_their_interface(site: FakeSite, hook: str, obj: str, expected: str) -> None:
    site.plugin("fake-bad", f"""
        import torch
        from nanovllm_core import AttentionBackend, hookimpl

        class Backend(AttentionBackend):
            def forward(self, q, k, v, kv_cache, metadata):
                return q

        class NoLogits(torch.nn.Module):
            def forward(self, input_ids, positions):
                return input_ids

            def load_weights(self, weights):
                pass

        @hookimpl
        def {hook}(register):
            register("x", {obj})
    """)
    registry = build_registry()
    [broken] = broken_of(registry, "fake-bad")
    assert expected in broken.error
    assert_others_still_load(registry)


def test_a_model_without_forward(site: FakeSite) -> None:
    site.plugin("fake-noforward", """
        import torch
        from nanovllm_core import hookimpl

        class NoForward(torch.nn.Module):
            def compute_logits(self, hidden_states):
                return hidden_states

            def load_weights(self, weights):
                pass

        @hookimpl
        def nanovllm_register_models(register):
            register("NoForward", NoForward)
    """)
    [broken] = broken_of(build_registry(), "fake-noforward")
    assert "lacks forward;" in broken.error and "CausalLM protocol" in broken.error


# --- hook implementations ---------------------------------------------------------------------------


DECORATED_HOOK = "from nanovllm_core import hookimpl\n\n@hookimpl\n"


@pytest.mark.parametrize(
    "source, expected",
    [
        pytest.param(
            DECORATED_HOOK + 'def nanovllm_register_schedulers(reg):\n    raise AssertionError("never called")\n',
            ["nanovllm_register_schedulers(reg) has the wrong signature",
             "write `def nanovllm_register_schedulers(register):`"],
            id="wrong-signature",
        ),
        pytest.param(
            DECORATED_HOOK + 'def nanovllm_register_scheduler(register):\n    register("x", object)\n',
            ["unknown hook 'nanovllm_register_scheduler'; did you mean 'nanovllm_register_schedulers'?"],
            id="typo-in-the-name",
        ),
        pytest.param(
            'def nanovllm_register_schedulers(register):\n    register("x", object)\n',
            ["not decorated with @nanovllm_core.hookimpl"],
            id="without-the-decorator",
        ),
        pytest.param("VALUE = 1\n", ["implements no nanovllm hook"], id="no-hooks"),
        pytest.param(
            DECORATED_HOOK + 'def nanovllm_register_schedulers(register):\n    raise RuntimeError("boom")\n',
            ["nanovllm_register_schedulers raised RuntimeError: boom at "],
            id="raises",
        ),
    ],
)  # fmt: skip
def test_a_broken_hook_is_reported_and_the_others_load(site: FakeSite, source: str, expected: list[str]) -> None:
    site.plugin("fake-hook", source)
    registry = build_registry()
    [broken] = broken_of(registry, "fake-hook")
    for text in expected:
        assert text in broken.error
    assert_others_still_load(registry)


# --- entry points that point nowhere ----------------------------------------------------------------


def test_an_entry_point_to_a_missing_module(site: FakeSite) -> None:
    site.dist("fake-nomodule", {"fake-nomodule": "no_such_module_xyz.plugin"})
    registry = build_registry()
    [broken] = broken_of(registry, "fake-nomodule")
    assert "points to module 'no_such_module_xyz.plugin', which cannot be imported" in broken.error
    assert "fix [project.entry-points.nanovllm]" in broken.error
    assert broken.distribution == "fake-nomodule"
    assert_others_still_load(registry)


def test_an_entry_point_to_a_missing_attribute(site: FakeSite) -> None:
    module = site.module("attr", "VALUE = 1\n")
    site.dist("fake-noattr", {"fake-noattr": f"{module}:plugin"})
    [broken] = broken_of(build_registry(), "fake-noattr")
    assert f"points to 'plugin', which module '{module}' does not define" in broken.error


def test_a_plugin_whose_dependency_is_missing(site: FakeSite) -> None:
    site.plugin("fake-nodep", "import not_installed_dependency_xyz\n")
    [broken] = broken_of(build_registry(), "fake-nodep")
    assert "install 'not_installed_dependency_xyz'" in broken.error


def test_a_plugin_that_fails_at_import(site: FakeSite) -> None:
    module = site.plugin("fake-crash", "raise RuntimeError('cannot start')\n")
    [broken] = broken_of(build_registry(), "fake-crash")
    assert "raised RuntimeError: cannot start at " in broken.error and f"{module}.py:1" in broken.error


@pytest.mark.parametrize("call", ["sys.exit(3)", "sys.exit()", "raise SystemExit('bye')"])
def test_a_plugin_that_calls_sys_exit_at_import_is_broken_and_the_others_load(site: FakeSite, call: str) -> None:
    module = site.plugin("fake-exit", f"import sys\n{call}\n")
    registry = build_registry()
    [broken] = broken_of(registry, "fake-exit")
    assert broken.distribution == "fake-exit"
    assert "called sys.exit(" in broken.error and f"{module}.py:2" in broken.error
    assert "must not end the process" in broken.error
    assert_others_still_load(registry)


def test_a_hook_that_calls_sys_exit_is_broken(site: FakeSite) -> None:
    site.plugin("fake-hookexit", """
        import sys
        from nanovllm_core import hookimpl

        NANOVLLM_PLUGIN_API = ">=2,<3"

        @hookimpl
        def nanovllm_register_schedulers(register):
            sys.exit(1)
    """)
    registry = build_registry()
    [broken] = broken_of(registry, "fake-hookexit")
    assert "nanovllm_register_schedulers raised SystemExit: 1" in broken.error
    assert_others_still_load(registry)
