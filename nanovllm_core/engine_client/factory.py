"""The one place that decides how engines run for an entry point."""

from __future__ import annotations

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine_client.base import EngineClient
from nanovllm_core.engine_client.step_loop import EngineProcess, InProcessClient
from nanovllm_core.plugins import get_registry


def make_engine_client(config: EngineConfig, *, engine_process: bool = False) -> EngineClient:
    """The client for a resolved config: with ``data_parallel_size`` > 1, the ``data_parallel_backend`` plugin's
    client of that many replicas (``mp``: processes on this host, ``ray``: Ray actors); else one engine in a process
    of its own when ``engine_process`` (a server's choice: its front-end then never competes with the step loop for
    the GIL), else an engine in this process. Every client serves both sync callers (``LLM``: pull) and async ones
    (``AsyncLLM``: push)."""
    if config.data_parallel_size > 1:
        return get_registry().get("data_parallel_backend", config.data_parallel_backend).obj(config)
    if engine_process:
        return EngineProcess(config)
    return InProcessClient(ModelEngineCore(config))
