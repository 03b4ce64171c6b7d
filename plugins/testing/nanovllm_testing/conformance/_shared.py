"""What the kits share: pytest's decorators imported lazily, in-process registration, the installed plugins a
check needs, the shared tiny checkpoint and a greedy run of the real engine."""

from __future__ import annotations

import hashlib
import shutil
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.hookspecs import PLUGIN_API_VERSION, hookimpl
from nanovllm_core.plugins import KINDS, get_registry, register_plugin, unregister_plugin
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_testing.checkpoints import hf_greedy, write_tiny_checkpoint

if TYPE_CHECKING:
    import pytest

    from nanovllm_testing.simulated import SimulatedEngine


_F = TypeVar("_F", bound=Callable[..., Any])


# pytest is imported where it is used, so that the kits import where pytest is not installed (their checks run
# under pytest only); the decorators the kits put on their methods are pytest's own when it is installed.
def _pytest_decorator(make: Callable[[Any], Callable[[_F], _F]]) -> Callable[[_F], _F]:
    try:
        import pytest
    except ModuleNotFoundError:
        return lambda function: function
    return make(pytest)


def fixture(**kwargs: Any) -> Callable[[_F], _F]:
    return _pytest_decorator(lambda pytest: pytest.fixture(**kwargs))


def parametrize(names: str, values: list[Any], ids: list[str]) -> Callable[[_F], _F]:
    return _pytest_decorator(lambda pytest: pytest.mark.parametrize(names, values, ids=ids))


@contextmanager
def registered_for_test(kind: str, cls: type, name: str | None = None) -> Iterator[str]:
    """Yield the name under which the engine finds ``cls``, registering it in-process if it is not installed.

    For ``kind="model"`` pass the architecture as ``name``: that is the name the engine looks up.
    """
    import pytest
    registry = get_registry()
    if name is None:
        found = [r.name for r in registry.registrations[kind].values() if r.obj is cls]
        if found:
            yield found[0]
            return
        name = f"conformance-{cls.__name__}"
    existing = registry.registrations[kind].get(name)
    if existing is not None:
        if existing.obj is not cls:
            pytest.fail(
                f"{kind} {name!r} is registered by plugin {existing.plugin} ({existing.distribution}) with "
                f"{existing.obj!r}, not {cls!r}; uninstall that distribution to test this class"
            )
        yield name
        return
    plugin = types.ModuleType(f"nanovllm_conformance_{kind}_{cls.__name__}")

    def hook(register: Any) -> None:
        register(name, cls)

    setattr(plugin, KINDS[kind], hookimpl(hook))
    plugin.NANOVLLM_PLUGIN_API = str(PLUGIN_API_VERSION)
    register_plugin(plugin, name=plugin.__name__)
    try:
        registry = get_registry()
        if name not in registry.registrations[kind]:
            errors = "; ".join(b.error for b in registry.broken if b.plugin == plugin.__name__)
            pytest.fail(f"{cls!r} cannot be registered as a {kind}: {errors}")
        yield name
    finally:
        unregister_plugin(plugin.__name__)


def installed_plugin(kind: str, name: str, setting: str) -> Any:
    """The installed registration of ``name``; skips the check (saying how to run it) when it is not installed."""
    import pytest
    registry = get_registry()
    if name not in registry.registrations[kind]:
        pytest.skip(f"this check uses the {kind} {name!r}, which is not installed: install it or set `{setting}`")
    return registry.get(kind, name)


def shared_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str = "qwen3", **options: Any) -> Path:
    """A tiny random-weight checkpoint, written once per pytest session and shared by every kit."""
    key = hashlib.sha1(repr(sorted(options.items())).encode()).hexdigest()[:10]
    path = tmp_path_factory.getbasetemp() / "nanovllm-conformance" / f"{arch}-{key}"
    if not path.is_dir():
        partial = path.with_name(f"{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_tiny_checkpoint(partial, arch, **options)
        partial.rename(path)  # only a complete checkpoint gets the shared name
    return path


def shared_checkpoint_fixture() -> Any:
    """A kit's class-scoped fixture of :func:`shared_tiny_checkpoint` (Qwen3): the class attribute it is assigned
    to names it."""

    @fixture(scope="class")
    @classmethod
    def checkpoint(cls: type, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return shared_tiny_checkpoint(tmp_path_factory)

    return checkpoint


def run_engine(
    engine: ModelEngineCore, prompts: list[list[int]], max_tokens: int, max_steps: int = 10_000
) -> list[list[int]]:
    import pytest
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"conformance-{i}") for i, p in enumerate(prompts)]
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    else:
        pytest.fail(f"the engine did not finish {len(prompts)} requests within {max_steps} steps")
    missing = [i for i in ids if i not in outputs]
    assert not missing, f"requests {missing} never came back from ModelEngineCore.step()"
    return [outputs[i] for i in ids]


def _first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first difference at output token {i}: got {a}, expected {b}"
    return f"lengths differ: got {len(got)} tokens, expected {len(want)}"


def assert_matches_transformers(
    checkpoint: Path, prompts: list[list[int]], got: list[list[int]], max_tokens: int
) -> None:
    """``got`` equals ``transformers``' greedy output of ``prompts``, prompt for prompt."""
    want = hf_greedy(checkpoint, prompts, max_tokens)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i} ({len(prompts[i])} tokens): " + _first_difference(g, w)


def assert_done(sim: SimulatedEngine, num_requests: int | None = None) -> None:
    """``num_requests`` finished (when given), every output exact and every block free."""
    if num_requests is not None:
        assert len(sim.finished) == num_requests, f"{len(sim.finished)} of {num_requests} requests finished"
    sim.assert_outputs_exact()
    sim.assert_all_blocks_free()
