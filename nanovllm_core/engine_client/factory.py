"""The one place that decides how engines run for an entry point."""

from __future__ import annotations

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine_client.base import EngineClient
from nanovllm_core.engine_client.data_parallel import DataParallelClient
from nanovllm_core.engine_client.ray_client import RayDataParallelClient  # imports ray only when one starts
from nanovllm_core.engine_client.step_loop import EngineProcess, InProcessClient


def make_engine_client(config: EngineConfig, *, engine_process: bool = False) -> EngineClient:
    """The client for a resolved config: data-parallel replicas when ``data_parallel_size`` > 1 (processes on this
    host, or Ray actors with ``data_parallel_backend = "ray"``), else one engine in a process of its own when
    ``engine_process`` (a server's choice: its front-end then never competes with the step loop for the GIL), else an
    engine in this process. Every client serves both sync callers (``LLM``: pull)
    and async ones (``AsyncLLM``: push)."""
    if config.data_parallel_size > 1:
        if config.data_parallel_backend == "ray":
            return RayDataParallelClient(config)
        return DataParallelClient(config)
    if engine_process:
        return EngineProcess(config)
    return InProcessClient(ModelEngineCore(config=config))
