"""The hooks a nanovllm plugin implements. Each receives ``register(name, factory)``.

A plugin module marks its implementations with ``@nanovllm_core.hookimpl`` and is announced by an entry
point in the ``nanovllm`` group of its distribution::

    [project.entry-points.nanovllm]
    my_plugin = "my_package.plugin"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "nanovllm"
ENTRY_POINT_GROUP = "nanovllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def nanovllm_register_schedulers(register: Register) -> None:
    """Register scheduler classes: ``register("fifo", FifoScheduler)``.

    The class implements :class:`nanovllm_core.interfaces.Scheduler` and is selected with
    ``[plugins] scheduler = "fifo"``. Called once per process when the plugins load.
    """


@hookspec
def nanovllm_register_block_managers(register: Register) -> None:
    """Register block manager classes: ``register("prefix_cache", PrefixCachingBlockManager)``.

    The class implements :class:`nanovllm_core.interfaces.BlockManager`; selected with
    ``[plugins] block_manager = "prefix_cache"``.
    """


@hookspec
def nanovllm_register_attention_backends(register: Register) -> None:
    """Register attention backend classes: ``register("torch", TorchAttentionBackend)``.

    The class implements :class:`nanovllm_core.interfaces.AttentionBackend`; selected with
    ``[plugins] attention = "torch"``, or picked by ``auto`` by its ``priority`` when it is available.
    """


@hookspec
def nanovllm_register_models(register: Register) -> None:
    """Register model classes by Hugging Face architecture name: ``register("Qwen3ForCausalLM", Qwen3ForCausalLM)``.

    The engine picks the class named by ``architectures[0]`` of the checkpoint's ``config.json``; it
    follows the :class:`nanovllm_core.interfaces.CausalLM` protocol.
    """
