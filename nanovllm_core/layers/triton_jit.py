"""Triton kernels written as plain functions, compiled for CUDA or run in Triton's interpreter (CPU tests).

Wrapping at first use instead of decorating with ``@triton.jit`` keeps ``triton`` an optional import and lets
one kernel body serve both: the compiled ``JITFunction`` on CUDA tensors and an ``InterpretedFunction`` on
anything else, so CI checks the same arithmetic on a CPU. Used by the core's kernels and by plugins'.

Programmatic dependent launch (PDL, compute capability 9.0 and newer): a kernel launched with it may start while
the kernel before it in the stream drains, so that one kernel's launch and set-up hide behind the tail of the
previous one; a decode step of a small model is a chain of a few hundred short kernels, where those gaps add up.
A kernel opts in with a ``PDL: tl.constexpr`` parameter and, before its first load::

    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here on
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching

and its launch passes :func:`launch_options`. A kernel that reads what an earlier kernel than the previous one
wrote is safe too: the previous kernel cannot finish before its own wait returns, after the earlier one finished.
Kernels launched without PDL (cuBLAS, torch) wait for the whole previous kernel, as always.
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


_pdl = False


def set_pdl(enabled: bool) -> None:
    """Launch the kernels that opt in with programmatic dependent launch (True) where the GPU has it,
    process-wide (config ``programmatic_dependent_launch``)."""
    global _pdl
    _pdl = enabled


@functools.cache
def _device_has_pdl(index: int) -> bool:
    import torch

    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.version.cuda is not None and torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(tensor: Any) -> dict[str, bool]:
    """The keyword arguments of a launch, on ``tensor``'s device, of a kernel with a ``PDL: tl.constexpr``
    parameter: ``PDL`` and Triton's ``launch_pdl``, on together where :func:`set_pdl` asked for it and the GPU
    has it (never in the interpreter)."""
    if _pdl and tensor.is_cuda:
        import torch

        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        if _device_has_pdl(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


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
