"""The entry point of nanovllm-data-parallel: the data-parallel backends ``mp`` and ``ray``."""

from __future__ import annotations

from nanovllm_core import hookimpl
from nanovllm_core.hookspecs import Register

NANOVLLM_PLUGIN_API = ">=2,<3"


@hookimpl
def nanovllm_register_data_parallel_backends(register: Register) -> None:
    # imported here: loading the plugins (every process does) must not load the engine clients
    from nanovllm_data_parallel.client import DataParallelClient
    from nanovllm_data_parallel.ray_client import RayDataParallelClient  # imports ray only when a client starts

    register("mp", DataParallelClient)
    register("ray", RayDataParallelClient)
