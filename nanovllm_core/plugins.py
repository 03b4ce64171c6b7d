"""Plugin discovery and the registries of schedulers, block managers, attention backends and models.

Entry points of the ``nanovllm`` group are loaded one by one (through :mod:`importlib.metadata`, as
pluggy's ``load_setuptools_entrypoints`` does), so that a plugin that fails to import is recorded with its
distribution and exception while every other plugin still loads.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from nanovllm_core import hookspecs
from nanovllm_core.errors import PluginConflictError, PluginError, UnknownPluginError

KINDS: dict[str, str] = {
    "scheduler": "nanovllm_register_schedulers",
    "block_manager": "nanovllm_register_block_managers",
    "attention": "nanovllm_register_attention_backends",
    "model": "nanovllm_register_models",
}


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str

    @property
    def module(self) -> str:
        return getattr(self.obj, "__module__", "?")


@dataclass(frozen=True)
class BrokenPlugin:
    plugin: str
    distribution: str
    version: str
    error: str


@dataclass
class PluginRegistry:
    """What the installed plugins registered, kind by kind, plus the plugins that failed to load."""

    plugin_manager: pluggy.PluginManager
    registrations: dict[str, dict[str, Registration]] = field(default_factory=lambda: {k: {} for k in KINDS})
    broken: list[BrokenPlugin] = field(default_factory=list)
    distributions: dict[str, tuple[str, str]] = field(default_factory=dict)  # plugin name -> (dist, version)

    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations[kind])

    def get(self, kind: str, name: str) -> Registration:
        entries = self.registrations[kind]
        if name not in entries:
            installed = ", ".join(sorted(entries)) or "none"
            hint = _kind_hint(kind)
            msg = f"no {kind.replace('_', ' ')} named {name!r} is installed; installed: {installed}. {hint}"
            broken = [b for b in self.broken]
            if broken:
                msg += " Plugins that failed to load: " + "; ".join(
                    f"{b.plugin} ({b.distribution}): {b.error}" for b in broken
                )
            raise UnknownPluginError(msg)
        return entries[name]

    def all(self) -> list[Registration]:
        return [r for kind in KINDS for r in sorted(self.registrations[kind].values(), key=lambda r: r.name)]


def _kind_hint(kind: str) -> str:
    return {
        "scheduler": "Install a scheduler plugin (e.g. nanovllm-scheduler-fifo) or fix [plugins] scheduler.",
        "block_manager": "Install a block manager plugin (e.g. nanovllm-scheduler-fifo) or fix "
        "[plugins] block_manager.",
        "attention": "Install an attention plugin (e.g. nanovllm-attention-flash) or fix [plugins] attention.",
        "model": "Install a model plugin that supports this architecture (e.g. nanovllm-models-qwen3).",
    }[kind]


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))


def build_registry(extra_plugins: list[tuple[str, ModuleType | object]] | None = None) -> PluginRegistry:
    """Load every installed plugin (plus ``extra_plugins`` given as ``(name, module)``) into a fresh registry."""
    pm = new_plugin_manager()
    registry = PluginRegistry(plugin_manager=pm)
    seen: set[str] = set()
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        key = f"{dist}:{ep.name}"
        if key in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(key)
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
            registry.broken.append(
                BrokenPlugin(ep.name, dist, version, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}")
            )
            continue
        _register_plugin(registry, ep.name, plugin, dist, version)
    for name, plugin in extra_plugins or []:
        _register_plugin(registry, name, plugin, "(registered in-process)", "")
    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            dist, version = registry.distributions.get(impl.plugin_name, ("?", "?"))
            register = _make_register(registry, kind, impl.plugin_name, dist, version)
            try:
                impl.function(*[{"register": register}[arg] for arg in impl.argnames])
            except PluginConflictError:
                raise
            except Exception as exc:  # noqa: BLE001
                registry.broken.append(
                    BrokenPlugin(impl.plugin_name, dist, version, f"{hook_name} raised {type(exc).__name__}: {exc}")
                )
    return registry


def _register_plugin(registry: PluginRegistry, name: str, plugin: Any, dist: str, version: str) -> None:
    try:
        registry.plugin_manager.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        registry.broken.append(BrokenPlugin(name, dist, version, f"invalid hook implementation: {exc}"))
        return
    except ValueError as exc:  # already registered under that name
        registry.broken.append(BrokenPlugin(name, dist, version, str(exc)))
        return
    registry.distributions[name] = (dist, version)


def _make_register(registry: PluginRegistry, kind: str, plugin: str, dist: str, version: str):
    def register(name: str, obj: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} ({dist}) registered a {kind} with an invalid name {name!r}")
        if not (inspect.isclass(obj) or callable(obj)):
            raise PluginError(f"plugin {plugin!r} ({dist}) registered {kind} {name!r} as {obj!r}, not a class")
        entries = registry.registrations[kind]
        if name in entries:
            other = entries[name]
            raise PluginConflictError(
                f"two plugins register a {kind.replace('_', ' ')} named {name!r}: "
                f"{other.plugin} from {other.distribution} {other.version} and {plugin} from {dist} {version}. "
                "Uninstall one of the distributions or rename the registration."
            )
        entries[name] = Registration(kind, name, obj, plugin, dist, version)

    return register


_registry: PluginRegistry | None = None
_extra_plugins: list[tuple[str, Any]] = []
_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first use (each engine process builds its own)."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry(_extra_plugins)
        return _registry


def register_plugin(plugin: ModuleType | object, name: str | None = None) -> None:
    """Register a plugin object in this process without installing a distribution (like pytest's ``-p``)."""
    global _registry
    with _lock:
        _extra_plugins.append((name or getattr(plugin, "__name__", repr(plugin)), plugin))
        _registry = None


def unregister_plugin(name: str) -> None:
    global _registry
    with _lock:
        _extra_plugins[:] = [(n, p) for n, p in _extra_plugins if n != name]
        _registry = None


def reset_registry() -> None:
    """Forget the loaded plugins; the next :func:`get_registry` rediscovers them."""
    global _registry
    with _lock:
        _registry = None
