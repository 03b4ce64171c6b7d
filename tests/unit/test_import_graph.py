"""The import graph of nanovllm_core: no cycle, imports pointing down only, no plugin imported, and light imports for
plugins.

Read from the source with the standard library's ``ast``: every ``import`` and ``from ... import`` counts, inside
functions too, except under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nanovllm_core

ROOT = Path(nanovllm_core.__file__).parent
PACKAGE = "nanovllm_core"

# The layers, top to bottom. A module may import its own layer and the ones below it, never one above.
# Modules named in no layer (config, errors, outputs, sampling_params, interfaces, hookspecs, plugins, layers, ...)
# are the foundation, below the engine.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("nanovllm_core", "nanovllm_core.entrypoints", "nanovllm_core.serving", "nanovllm_core.cli",
                      "nanovllm_core.demo")),  # fmt: skip
    ("engine clients", ("nanovllm_core.engine_client",)),
    ("engine", ("nanovllm_core.engine",)),
]
FOUNDATION = "foundation"


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in LAYERS (len(LAYERS) for the foundation). The root package itself is an
    entry point (it re-exports LLM and AsyncLLM); its submodules are matched by their longest prefix."""
    best, best_len = len(LAYERS), -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix if prefix == PACKAGE else module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def layer_name(index: int) -> str:
    return LAYERS[index][0] if index < len(LAYERS) else FOUNDATION


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str) -> set[str]:
    """The nanovllm_core modules ``module`` imports. ``from P import n`` names P, and P.n as well when that is a
    module; ``import P.Q`` and ``from P.Q import x`` name P.Q."""
    return {m for m in all_imports_of(module) if m in MODULES and m != module}


def all_imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, nanovllm_core's and others', named as :func:`imports_of` names them."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_the_graph_is_read():
    assert "nanovllm_core.engine.core" in GRAPH["nanovllm_core.engine.model_core"]
    assert "nanovllm_core.engine_client.factory" in GRAPH["nanovllm_core.entrypoints.llm_engine"]
    assert len(MODULES) > 50


def test_no_import_cycle():
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()
    cycles: list[list[str]] = []

    def walk(module: str) -> None:
        path.append(module)
        on_path.add(module)
        for target in sorted(GRAPH[module]):
            if target in on_path:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in done:
                walk(target)
        on_path.discard(path.pop())
        done.add(module)

    for module in sorted(GRAPH):
        if module not in done:
            walk(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if layer_of(target) < layer_of(module):
                upward.append(
                    f"{module} ({layer_name(layer_of(module))}) -> {target} ({layer_name(layer_of(target))})"
                )
            elif module.startswith("nanovllm_core.layers") and layer_of(target) < len(LAYERS):
                upward.append(f"{module} (model layers) -> {target} ({layer_name(layer_of(target))})")
    assert not upward, "imports pointing up:\n" + "\n".join(sorted(upward))


def test_the_core_imports_no_plugin():
    """Not one of the other distributions' packages (``nanovllm_bench``, ``nanovllm_testing``, ...): what the
    core needs of them stays in the core, and a command of theirs comes through ``nanovllm_register_commands``."""
    found = sorted(
        f"{module} -> {target}"
        for module in MODULES
        for target in all_imports_of(module)
        if target.startswith("nanovllm_") and target.split(".")[0] != PACKAGE
    )
    assert not found, "the core imports plugins:\n" + "\n".join(found)


def test_a_plugins_imports_load_neither_the_engine_nor_the_server():
    code = (
        "import sys, nanovllm_core, nanovllm_core.hookspecs, nanovllm_core.interfaces\n"
        "heavy = [m for m in sys.modules if m in ('fastapi', 'nanovllm_core.engine.model_runner', 'nanovllm_core.cli')"
        " or m.startswith(('nanovllm_core.serving', 'nanovllm_core.engine.', 'nanovllm_core.engine_client',"
        " 'nanovllm_core.entrypoints'))]\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert "LLM" in dir(nanovllm_core) and nanovllm_core.LLM.__module__ == "nanovllm_core.entrypoints.llm"
