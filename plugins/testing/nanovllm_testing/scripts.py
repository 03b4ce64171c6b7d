"""Load a script (a benchmark, an example) as a module for a test, without leaving its folder on ``sys.path``.

A script folder on ``sys.path`` shadows every installed package whose name matches one of its files (a
``kernels.py`` there hides the ``kernels`` distribution that ``transformers`` imports), for the rest of the
process. ``load_script`` puts the folder first only while the script runs its imports, then restores
``sys.path`` and drops the sibling modules it imported from ``sys.modules``; the script itself is kept under a
private name (its dataclasses look their module up there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType


@contextlib.contextmanager
def folder_on_sys_path(folder: str | Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` inside the block; ``sys.path`` exactly as it was after it."""
    saved = list(sys.path)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path[:] = saved


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """The script at ``path`` imported as module ``name`` (default ``_script_<stem>``); its ``__main__`` block
    does not run. Modules it imported from its own folder (``_common``) are dropped from ``sys.modules`` after."""
    path = Path(path).resolve()
    name = name or f"_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module: not a Python file")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.modules[name] = module
    try:
        with folder_on_sys_path(path.parent):
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        for added in set(sys.modules) - before - {name}:
            origin = getattr(sys.modules[added], "__file__", None)
            if origin and Path(origin).resolve().parent == path.parent:
                del sys.modules[added]
    return module
