"""Plugin discovery and the registries of schedulers, block managers, attention backends and models.

Entry points of the ``nanovllm`` group are found with the standard library's :mod:`importlib.metadata` (what
pluggy's ``load_setuptools_entrypoints`` uses; the old ``entrypoints`` package is not used) and loaded one
by one, so that a plugin that fails is recorded as a :class:`BrokenPlugin` with its distribution and a hint
on how to fix it, while every other plugin still loads. Before a plugin is registered it is checked:

- its ``NANOVLLM_PLUGIN_API`` declaration against :data:`nanovllm_core.PLUGIN_API_VERSION`;
- its hook implementations: known hook names, the ``register`` argument, no undecorated hook functions;
- every object it registers against the interface of its kind (:func:`check_registration`).

Two plugins that register the same name for the same kind are a conflict: the registry keeps both (so that
``nanovllm plugins`` lists them) and asking for that name raises :class:`PluginConflictError` naming both
distributions; every other name still works.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import operator
import re
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy
from torch import nn

import nanovllm_core.hookspecs as hookspecs
from nanovllm_core.commands import Command
from nanovllm_core.errors import ModelLoadError, PluginConflictError, UnknownPluginError
from nanovllm_core.interfaces import AttentionBackend, BlockManager, Scheduler
from nanovllm_core.parsing import ReasoningParser, ToolParser
from nanovllm_core.quantization import QuantizationMethod
from nanovllm_core.structured_output import StructuredOutputBackend

KINDS: dict[str, str] = {
    "scheduler": "nanovllm_register_schedulers",
    "block_manager": "nanovllm_register_block_managers",
    "attention": "nanovllm_register_attention_backends",
    "model": "nanovllm_register_models",
    "structured_output": "nanovllm_register_structured_output_backends",
    "tool_parser": "nanovllm_register_tool_parsers",
    "reasoning_parser": "nanovllm_register_reasoning_parsers",
    "command": "nanovllm_register_commands",
    "quantization": "nanovllm_register_quantization_methods",
    "data_parallel_backend": "nanovllm_register_data_parallel_backends",
}
HOOK_NAMES = frozenset(KINDS.values())
API_ATTRIBUTE = "NANOVLLM_PLUGIN_API"
"""The module attribute in which a plugin declares the plugin API versions it supports, e.g. ``">=2,<3"``;
a plugin that declares nothing is taken to support the core's current API."""

PROVIDERS: dict[str, dict[str, str]] = {
    "scheduler": {
        "fifo": "nanovllm-scheduler-fifo",
        "mixed": "nanovllm-scheduler-mixed",
        "priority": "nanovllm-scheduler-priority",
    },
    "block_manager": {"prefix_cache": "nanovllm-scheduler-fifo"},
    "attention": {"torch": "nanovllm-attention-flash", "triton": "nanovllm-attention-flash",
                  "flash_attn": "nanovllm-attention-flash", "flashinfer": "nanovllm-attention-flashinfer"},
    "model": {
        "Qwen3ForCausalLM": "nanovllm-models-qwen3",
        "Qwen2ForCausalLM": "nanovllm-models-qwen3",
        "Qwen3MoeForCausalLM": "nanovllm-models-qwen3",
    },
    "structured_output": {"xgrammar": "nanovllm-structured-xgrammar", "guidance": "nanovllm-structured-llguidance"},
    "quantization": {"fp8": "nanovllm-quant-fp8", "compressed-tensors": "nanovllm-quant-fp8"},
    "command": {"bench": "nanovllm-bench", "simulate": "nanovllm-bench"},
    "data_parallel_backend": {"mp": "nanovllm-data-parallel", "ray": "nanovllm-data-parallel"},
}
"""The nanovllm distribution that registers each of the project's own names, kind by kind (for error messages)."""
REPLY_PARSER_FLAGS = {"tool_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser"}

_BASES: dict[str, type] = {
    "scheduler": Scheduler,
    "block_manager": BlockManager,
    "attention": AttentionBackend,
    "tool_parser": ToolParser,
    "reasoning_parser": ReasoningParser,
    "structured_output": StructuredOutputBackend,
    "command": Command,
    "quantization": QuantizationMethod,
}
_MODEL_METHODS = ("forward", "compute_logits", "load_weights")
ENGINE_CLIENT = ("nanovllm_core.engine_client.base", "EngineClient")


@dataclass(frozen=True)
class Registration:
    """One named object a plugin registered (``kind`` is one of :data:`KINDS`)."""

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
    """A plugin (or one of its registrations) that could not be loaded, and why; ``error`` says how to fix it."""

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
    conflicts: dict[str, dict[str, list[Registration]]] = field(default_factory=lambda: {k: {} for k in KINDS})
    """Names registered more than once, kind by kind, with every registration; they are not in ``registrations``."""

    def names(self, kind: str) -> list[str]:
        """The names of ``kind`` that can be selected (conflicting names are not among them)."""
        return sorted(self.registrations[kind])

    def get(self, kind: str, name: str) -> Registration:
        entries = self.registrations[kind]
        if name in self.conflicts[kind]:
            raise PluginConflictError(conflict_message(self.conflicts[kind][name]))
        if name not in entries:
            installed = ", ".join(sorted(entries)) or "none"
            label = kind.replace("_", " ")
            msg = f"no {label} named {name!r} is installed; installed: {installed}. {missing_hint(kind, name)}"
            if self.broken:
                msg += " Plugins that failed to load: " + "; ".join(
                    f"{b.plugin} ({b.distribution}): {b.error}" for b in self.broken
                )
            raise UnknownPluginError(msg)
        return entries[name]

    def all(self) -> list[Registration]:
        """Every registration, conflicting ones included, by kind then name."""
        out = []
        for kind in KINDS:
            regs = list(self.registrations[kind].values())
            regs += [r for clashing in self.conflicts[kind].values() for r in clashing]
            out += sorted(regs, key=lambda r: r.name)
        return out

    def add_broken(self, plugin: str, error: str) -> None:
        dist, version = self.distributions.get(plugin, ("?", "?"))
        self.broken.append(BrokenPlugin(plugin, dist, version, error))


def conflict_message(clashing: list[Registration]) -> str:
    """Why a name registered by several plugins cannot be used, naming each plugin and distribution."""
    first = clashing[0]
    count = "two" if len(clashing) == 2 else str(len(clashing))
    who = [f"{r.plugin} from {r.distribution} {r.version}".rstrip() for r in clashing]
    return (
        f"{count} plugins register a {first.kind.replace('_', ' ')} named {first.name!r}: "
        f"{', '.join(who[:-1])} and {who[-1]}. Uninstall one of the distributions or rename the registration."
    )


def missing_hint(kind: str, name: str) -> str:
    """How to get the ``kind`` named ``name``: the distribution that ships it when it is one of the project's."""
    dist = PROVIDERS.get(kind, {}).get(name)
    if dist is not None:
        return f"It ships in {dist}: pip install {dist}"
    if kind == "model":
        return "Install a model plugin that registers this architecture."
    if kind in REPLY_PARSER_FLAGS:
        return f"Install a plugin that registers it, or fix {REPLY_PARSER_FLAGS[kind]}."
    if kind == "quantization":
        return "Install a plugin that registers this quantization method, or fix `quantization` (--quantization)."
    if kind == "data_parallel_backend":
        return "Install a plugin that registers it, or fix `data_parallel_backend` (--data-parallel-backend)."
    return f"Install the plugin that registers it, or fix [plugins] {kind}."


def none_installed_hint(kind: str) -> str:
    """What to install when no plugin registers any ``kind`` at all: the project's distributions of that kind."""
    names = PROVIDERS.get(kind, {})
    dists = sorted(set(names.values()))
    if not dists:
        return f"install a plugin that registers a {kind.replace('_', ' ')}"
    return f"{', '.join(names)} ship in {' and '.join(dists)}: pip install {' '.join(dists)}"


# ----------------------------------------------------------------------------------------------------
# Plugin API versions
# ----------------------------------------------------------------------------------------------------

_OPERATORS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<)?\s*(\d+)\s*$")


def api_supported(spec: object, version: int) -> bool:
    """Whether a ``NANOVLLM_PLUGIN_API`` declaration admits plugin API ``version``.

    ``spec`` is an integer (that version only) or comma-separated clauses over integers, all of which must
    hold: ``"1"``, ``">=1,<3"``, ``"!=2"``. Raises ``ValueError`` for anything else.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec == version
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{spec!r} is not a version specifier")
    ok = True
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"{spec!r} is not a version specifier (bad clause {clause.strip()!r})")
        ok = ok and _OPERATORS[match.group(1) or "=="](version, int(match.group(2)))
    return ok


def _api_problem(plugin: Any) -> str | None:
    if not hasattr(plugin, API_ATTRIBUTE):
        return None
    spec = getattr(plugin, API_ATTRIBUTE)
    core = f"nanovllm-core {hookspecs.CORE_VERSION} provides plugin API {hookspecs.PLUGIN_API_VERSION}"
    try:
        supported = api_supported(spec, hookspecs.PLUGIN_API_VERSION)
    except ValueError:
        return (
            f"{API_ATTRIBUTE} = {spec!r} is not a version specifier; write an integer or clauses such as "
            f"'>={hookspecs.PLUGIN_API_VERSION},<{hookspecs.PLUGIN_API_VERSION + 1}' ({core})"
        )
    if supported:
        return None
    return (
        f"incompatible plugin API: the plugin declares {API_ATTRIBUTE} = {spec!r} but {core}; install a release "
        "of the plugin that supports this API, or a nanovllm-core that provides an API the plugin supports"
    )


# ----------------------------------------------------------------------------------------------------
# Checks a plugin author hits: hook implementations and registered objects
# ----------------------------------------------------------------------------------------------------


def _hook_problems(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    """What is wrong with a plugin's hook implementations (typos, wrong arguments, missing decorator)."""
    problems = []
    marked = 0
    for attr in dir(plugin):
        try:
            value = getattr(plugin, attr)
        except Exception:  # noqa: BLE001 - a property that raises is not a hook
            continue
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is None:
            if attr.startswith("nanovllm_register") and inspect.isroutine(value):
                problems.append(
                    f"{attr}() is not decorated with @nanovllm_core.hookimpl, so it is never called; "
                    f"add `@hookimpl` (from nanovllm_core import hookimpl) above `def {attr}`"
                )
            continue
        marked += 1
        hook_name = opts.get("specname") or attr
        if hook_name not in HOOK_NAMES:
            close = difflib.get_close_matches(hook_name, sorted(HOOK_NAMES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"{attr}() implements an unknown hook {hook_name!r}; {hint}"
                f"the hooks are: {', '.join(sorted(HOOK_NAMES))}"
            )
            continue
        if opts.get("wrapper") or opts.get("hookwrapper"):
            problems.append(f"{attr}() is declared as a wrapper; registration hooks are plain functions")
            continue
        args = list(inspect.signature(value).parameters)
        if args != ["register"]:
            problems.append(
                f"{attr}({', '.join(args)}) has the wrong signature: a hook implementation takes exactly one "
                f"argument named `register` (pluggy passes it by name); write `def {attr}(register):`"
            )
    if marked == 0 and not problems:
        problems.append(
            "the plugin implements no nanovllm hook, so it registers nothing; decorate a function such as "
            "`def nanovllm_register_schedulers(register)` with @nanovllm_core.hookimpl"
        )
    return problems


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def check_registration(kind: str, obj: Any) -> str | None:
    """``None`` if ``obj`` can be registered as a ``kind``, else what is wrong and how to fix it."""
    if not inspect.isclass(obj):
        what = f"an instance of {type(obj).__name__}" if not callable(obj) else f"{obj!r}, not a class"
        return f"got {what}; register the class itself, e.g. register(name, MyClass)"
    if kind == "model":
        if not issubclass(obj, nn.Module):
            return (
                f"{_qualname(obj)} is not a torch.nn.Module; a model class subclasses nn.Module and implements "
                + ", ".join(_MODEL_METHODS) + " (the nanovllm_core.CausalLM protocol)"
            )
        missing = [m for m in _MODEL_METHODS if not callable(getattr(obj, m, None))]
        if getattr(obj, "forward", None) is nn.Module.forward:
            missing.insert(0, "forward")
        if missing:
            return (
                f"{_qualname(obj)} lacks {', '.join(missing)}; a model class implements "
                "forward(input_ids, positions), compute_logits(hidden_states) and load_weights(weights) "
                "(the nanovllm_core.CausalLM protocol)"
            )
        return None
    if kind == "data_parallel_backend":  # EngineClient lives a layer above the registry: found by name in the MRO
        if not any(c.__module__ == ENGINE_CLIENT[0] and c.__qualname__ == ENGINE_CLIENT[1] for c in obj.__mro__):
            return (
                f"{_qualname(obj)} is not a subclass of {'.'.join(ENGINE_CLIENT)}; a data-parallel backend is an "
                "engine client built as cls(config)"
            )
        return None
    base = _BASES[kind]
    if not issubclass(obj, base):
        return (
            f"{_qualname(obj)} is not a subclass of nanovllm_core.{base.__name__}; declare it as "
            f"`class {obj.__name__}(nanovllm_core.{base.__name__})`"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        return f"{_qualname(obj)} does not implement {missing} (abstract in nanovllm_core.{base.__name__})"
    return None


# ----------------------------------------------------------------------------------------------------
# Discovery
# ----------------------------------------------------------------------------------------------------


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))


def _import_error(ep: importlib.metadata.EntryPoint, dist: str, exc: BaseException) -> str:
    """Explain why an entry point did not load, and how to fix it."""
    module, _, attr = (part.strip() for part in ep.value.partition(":"))
    where = f"entry point {ep.name} = {ep.value!r} (group {hookspecs.ENTRY_POINT_GROUP!r} of {dist})"
    fix_entry = (
        "fix [project.entry-points.nanovllm] in the distribution's pyproject.toml and reinstall it "
        "(pip install -e .)"
    )
    if isinstance(exc, ModuleNotFoundError) and exc.name and (module == exc.name or module.startswith(exc.name + ".")):
        return f"{where} points to module {module!r}, which cannot be imported ({exc}); {fix_entry}"
    if isinstance(exc, AttributeError) and attr and module in sys.modules and not _has_path(sys.modules[module], attr):
        return f"{where} points to {attr!r}, which module {module!r} does not define; {fix_entry}"
    if isinstance(exc, ModuleNotFoundError):
        return (
            f"importing {module!r} failed: {exc}; install {exc.name!r} (and list it in the distribution's "
            "dependencies)"
        )
    at = _raised_at(exc)
    if isinstance(exc, SystemExit):
        return (
            f"importing {ep.value!r} called sys.exit({'' if exc.code is None else repr(exc.code)}){at}; a plugin "
            "module must not end the process when it is imported: raise an exception instead"
        )
    return f"importing {ep.value!r} raised {type(exc).__name__}: {exc}{at}"


def _raised_at(exc: BaseException) -> str:
    """`` at FILE:LINE`` of the frame that raised ``exc`` (empty without a traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _has_path(obj: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def build_registry(extra_plugins: list[tuple[str, ModuleType | object]] | None = None) -> PluginRegistry:
    """Load every installed plugin (plus ``extra_plugins`` given as ``(name, module)``) into a fresh registry.

    Never raises for a plugin that is broken (it lands in :attr:`PluginRegistry.broken`, even when it calls
    ``sys.exit()``), nor for two plugins registering the same name for the same kind (that lands in
    :attr:`PluginRegistry.conflicts`).
    """
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
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - any import failure, sys.exit() included, is reported
            registry.broken.append(BrokenPlugin(ep.name, dist, version, _import_error(ep, dist, exc)))
            continue
        _register_plugin(registry, ep.name, plugin, dist, version)
    for name, plugin in extra_plugins or []:
        _register_plugin(registry, name, plugin, "(registered in-process)", "")
    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            register = _make_register(registry, kind, impl.plugin_name)
            try:
                impl.function(register=register)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - sys.exit() in a hook is reported too
                error = f"{hook_name} raised {type(exc).__name__}: {exc}{_raised_at(exc)}"
                registry.add_broken(impl.plugin_name, error)
    return registry


def _register_plugin(registry: PluginRegistry, name: str, plugin: Any, dist: str, version: str) -> None:
    pm = registry.plugin_manager
    if pm.has_plugin(name):  # two distributions chose the same entry-point name: keep both
        name = f"{name} ({dist})"
    problem = _api_problem(plugin)
    problems = [problem] if problem else _hook_problems(pm, plugin)
    if not problems:
        try:
            pm.register(plugin, name=name)
            registry.distributions[name] = (dist, version)
            return
        except pluggy.PluginValidationError as exc:
            problems = [f"invalid hook implementation: {exc}; a hook takes `register` only"]
        except ValueError as exc:  # the same module behind two entry points
            problems = [f"{exc}; each plugin module may be named by one entry point only"]
    registry.broken += [BrokenPlugin(name, dist, version, problem) for problem in problems]


def _make_register(registry: PluginRegistry, kind: str, plugin: str) -> Callable[[str, Any], None]:
    dist, version = registry.distributions.get(plugin, ("?", "?"))

    def register(name: str, obj: Any) -> None:
        label = kind.replace("_", " ")
        if not isinstance(name, str) or not name:
            registry.add_broken(plugin, f"registered a {label} under an invalid name {name!r}; use a non-empty string")
            return
        problem = check_registration(kind, obj)
        if problem is not None:
            registry.add_broken(plugin, f"registered {label} {name!r} that does not satisfy its interface: {problem}")
            return
        entries, conflicts = registry.registrations[kind], registry.conflicts[kind]
        registration = Registration(kind, name, obj, plugin, dist, version)
        if name in conflicts:
            conflicts[name].append(registration)
        elif name in entries:
            conflicts[name] = [entries.pop(name), registration]
        else:
            entries[name] = registration

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
    """Forget a plugin given to :func:`register_plugin`."""
    global _registry
    with _lock:
        _extra_plugins[:] = [(n, p) for n, p in _extra_plugins if n != name]
        _registry = None


def reset_registry() -> None:
    """Forget the loaded plugins; the next :func:`get_registry` rediscovers them."""
    global _registry
    with _lock:
        _registry = None


def installed_architecture(registry: PluginRegistry, model: str, architectures: list[str] | None) -> str:
    """The checkpoint's architecture (the first of config.json's ``architectures``); a ModelLoadError when there is
    none or no installed model plugin provides it."""
    if not architectures:
        raise ModelLoadError(f"{model}/config.json names no architecture ('architectures' is empty)")
    arch = architectures[0]
    if arch not in registry.registrations["model"] and arch not in registry.conflicts["model"]:
        installed = ", ".join(registry.names("model")) or "none"
        raise ModelLoadError(
            f"architecture {arch!r} is not provided by any installed model plugin; installed: {installed}. "
            + missing_hint("model", arch)
        )
    return arch
