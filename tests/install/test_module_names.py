"""No file or folder of this repository that can land on ``sys.path`` takes the top-level name of a distribution.

A folder lands on ``sys.path`` when a script in it runs (``python benchmarks/NAME.py``), when pytest imports a
test file from it (its rootdir-based import mode puts the file's folder first) or when a test adds it. Every
module and folder visible from there then shadows the installed package of the same name for the whole process:
``benchmarks/kernels.py`` hid the ``kernels`` distribution that ``transformers`` imports, and ``tests/ray`` passed
for ``ray`` where Ray is not installed. Names are checked against every installed distribution's top-level
modules and against every dependency the repository's distributions declare (installed or not).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
from nanovllm_testing.scripts import folder_on_sys_path, load_script

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SKIP_FOLDERS = {".git", "__pycache__", "build", "dist", "results", ".hypothesis", ".pytest_cache", ".ruff_cache"}
# declared distributions whose import name is not their normalised name (used when they are not installed here)
IMPORT_NAMES = {"flash-attn-4": "flash_attn", "pyyaml": "yaml", "flashinfer-python": "flashinfer"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def folders(root: Path) -> list[Path]:
    """The repository's folders, without hidden ones (``.git``, ``.venv``) and build or result folders."""
    found = []
    for here, subfolders, _ in os.walk(root):
        subfolders[:] = [
            d for d in subfolders if not (d.startswith(".") or d in SKIP_FOLDERS or d.endswith(".egg-info"))
        ]
        found.append(Path(here))
    return found


def pyprojects(root: Path) -> list[Path]:
    return [folder / "pyproject.toml" for folder in folders(root) if (folder / "pyproject.toml").is_file()]


def own_and_declared(root: Path) -> tuple[set[str], set[str]]:
    """The repository's own distribution names, and every distribution their pyproject files depend on."""
    own, declared = set(), set()
    for path in pyprojects(root):
        project = tomllib.loads(path.read_text()).get("project", {})
        own.add(normalise(project.get("name", "")))
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        declared |= {normalise(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}
    return own, declared - own


def taken_names(root: Path) -> dict[str, str]:
    """Top-level import name -> the distribution that takes it, for installed and declared distributions."""
    own, declared = own_and_declared(root)
    taken: dict[str, str] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        others = [d for d in dists if normalise(d) not in own]
        if others and module.isidentifier():
            taken[module] = others[0]
    installed = {normalise(d) for dists in importlib.metadata.packages_distributions().values() for d in dists}
    for dist in declared:
        if dist not in installed:  # its own top-level names are unknown here: the usual import name
            taken.setdefault(IMPORT_NAMES.get(dist, dist.replace("-", "_")), dist)
    return taken


def importable_names(root: Path) -> dict[str, list[str]]:
    """Every name a folder of the repository makes importable when it is on ``sys.path`` -> where (relative paths).

    The folders are those holding Python files that are not inside a package (a package's own folder is never put
    on the path); a name is a ``.py`` file's stem or a subfolder's name."""
    names: dict[str, list[str]] = {}
    for folder in folders(root):
        if (folder != root and not any(folder.glob("*.py"))) or (folder / "__init__.py").exists():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(".") or entry.name in SKIP_FOLDERS or entry.name.endswith(".egg-info"):
                continue
            name = entry.stem if entry.suffix == ".py" else entry.name if entry.is_dir() else None
            if name and name.isidentifier():
                names.setdefault(name, []).append(str(entry.relative_to(root)))
    return names


def shadowing(root: Path) -> list[str]:
    taken = taken_names(root)
    return sorted(
        f"{where} shadows the top-level module {name!r} of the distribution {taken[name]!r}: rename it"
        for name, places in importable_names(root).items()
        if name in taken
        for where in places
    )


def test_no_file_or_folder_shadows_a_distribution() -> None:
    found = shadowing(ROOT)
    assert not found, "\n".join(found)


def test_the_check_finds_a_benchmark_named_like_a_package_and_a_test_folder_named_ray(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "demo"\ndependencies = ["ray>=2", "flash-attn-4"]\n')
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "kernels.py").write_text("")
    (tmp_path / "benchmarks" / "offline.py").write_text("")
    (tmp_path / "tests" / "ray").mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text("")
    (tmp_path / "tests" / "ray" / "test_ray.py").write_text("")
    (tmp_path / "tests" / "flash_attn.py").write_text("")
    found = "\n".join(shadowing(tmp_path))
    kernels_installed = "kernels" in importlib.metadata.packages_distributions()
    assert ("benchmarks/kernels.py shadows" in found) == kernels_installed, found
    assert "tests/ray shadows the top-level module 'ray'" in found, found  # declared, installed or not
    assert "tests/flash_attn.py shadows the top-level module 'flash_attn'" in found, found
    assert "offline" not in found and "conftest" not in found


def test_load_script_leaves_sys_path_and_the_scripts_siblings_as_it_found_them(tmp_path: Path) -> None:
    (tmp_path / "_helper_for_load_script.py").write_text("VALUE = 3\n")
    (tmp_path / "script.py").write_text(
        "import dataclasses\nfrom _helper_for_load_script import VALUE\n\n"
        "@dataclasses.dataclass\nclass Row:\n    value: int = VALUE\n\n"
        "if __name__ == '__main__':\n    raise SystemExit('the main block ran')\n"
    )
    before = list(sys.path)
    module = load_script(tmp_path / "script.py")
    assert module.Row().value == 3
    assert sys.path == before
    assert "_helper_for_load_script" not in sys.modules
    with folder_on_sys_path(tmp_path):
        assert sys.path[0] == str(tmp_path)
    assert sys.path == before


def test_load_script_restores_sys_path_when_the_script_fails(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken at import')\n")
    before = list(sys.path)
    with pytest.raises(RuntimeError, match="broken at import"):
        load_script(tmp_path / "broken.py")
    assert sys.path == before and "_script_broken" not in sys.modules
