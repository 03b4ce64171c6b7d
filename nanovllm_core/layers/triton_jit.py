"""Triton kernels written as plain functions, compiled for CUDA or run in Triton's interpreter (CPU tests).

Wrapping at first use instead of decorating with ``@triton.jit`` keeps ``triton`` an optional import and lets
one kernel body serve both: the compiled ``JITFunction`` on CUDA tensors and an ``InterpretedFunction`` on
anything else, so CI checks the same arithmetic on a CPU. Used by the core's kernels and by plugins'.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any


def fix_interpreter_scalars() -> None:
    """Let Triton's interpreter use scalar tensors as loop bounds under NumPy >= 2.4.

    The interpreter keeps a scalar as a one-element 1-D array and turns it into a Python int with ``int(array)``
    (for ``range(lo, hi)`` with tensor bounds), which NumPy 2.4 rejects. The patch wraps the interpreter's
    per-launch patching so that ``__index__`` reads the single element instead; it touches interpreted runs
    only (compiled kernels never use it) and is undone with the rest of the interpreter's patches.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_nanovllm_scalar_fix", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._nanovllm_scalar_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def wrap_kernel(fn: Callable, interpret: bool, **options: Any) -> Any:
    """``fn`` as a launchable Triton kernel: compiled (``interpret=False``) or interpreted; ``options`` go to
    the wrapper (``do_not_specialize=[...]``)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        fix_interpreter_scalars()
        return InterpretedFunction(fn, **options)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn, **options)


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """``nanovllm_core.layers.<name>``, a module of Triton kernels that imports ``triton`` at its top, or None
    where triton cannot be imported (the core does not depend on it; callers keep their torch path)."""
    try:
        return importlib.import_module(f"nanovllm_core.layers.{name}")
    except ImportError:
        return None
