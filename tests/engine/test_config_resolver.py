"""The configuration is finished once per process (nanovllm_core.engine.config_resolver), before any engine client
exists; everything below receives the finished, frozen object."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from nanovllm_core import LLM
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine import config_resolver
from nanovllm_core.engine.config_resolver import create_engine_config, finish_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.engine.parallel import RunnerSpec, build_runner
from nanovllm_core.errors import ConfigError

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, warmup="off")


@pytest.fixture
def finishes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models of the configs finished in this process from now on (the attention backend is selected once per
    finishing, and only there)."""
    finished: list[str] = []
    select = config_resolver.select_attention_backend

    def counted(*args: Any, **kwargs: Any) -> Any:
        finished.append("finished")
        return select(*args, **kwargs)

    monkeypatch.setattr(config_resolver, "select_attention_backend", counted)
    return finished


def test_the_finished_config_is_concrete_and_frozen(qwen3_path: Path) -> None:
    config = create_engine_config(str(qwen3_path), device="cpu")
    assert config.finished
    assert config.max_model_len == 1024  # the checkpoint's max_position_embeddings
    assert (config.device, config.dtype) == ("cpu", "float32")
    assert config.plugins.attention != "auto" and config.plugins.attention in ("torch", "triton", "flash_attn")
    assert config.source_of("dtype") == "resolved; default gave 'auto'"
    assert config.source_of("max_num_seqs") == "default"
    with pytest.raises(ConfigError, match="max_model_len cannot be set: the configuration is finished"):
        config.max_model_len = 64
    with pytest.raises(ConfigError, match="PluginsConfig.scheduler cannot be set"):
        config.plugins.scheduler = "priority"
    copied = config.model_copy(update={"data_parallel_size": 1})  # what a replica gets: still finished
    assert copied.finished and copied.max_model_len == 1024
    again = pickle.loads(pickle.dumps(config))  # what an engine process or a replica receives
    assert again.finished and again == config
    with pytest.raises(ConfigError, match="cannot be set"):
        again.device = "cuda"



def test_a_tensor_parallel_rank_runs_the_finished_config(qwen3_path: Path, finishes: list[str]) -> None:
    config = create_engine_config(str(qwen3_path), **ENGINE)
    spec = RunnerSpec(config, "Qwen3ForCausalLM", config.plugins.attention, "cpu", config.dtype)
    finishes.clear()
    runner = build_runner(pickle.loads(pickle.dumps(spec)), rank=1)  # as a spawned worker receives it
    assert runner.config.finished and runner.config == config
    assert finishes == []

def test_a_second_finish_is_a_no_op(qwen3_path: Path, finishes: list[str]) -> None:
    config = create_engine_config(str(qwen3_path), device="cpu", max_model_len=256)
    assert finish_config(config) is config
    assert create_engine_config(config=config) is config
    assert len(finishes) == 1
    unfinished = EngineConfig.load(overrides={"model": str(qwen3_path), "device": "cpu"})
    assert not unfinished.finished
    unfinished.max_num_seqs = 8  # a config not finished yet can still be changed
    assert finish_config(unfinished).max_num_seqs == 8 and len(finishes) == 2
    with pytest.raises(ConfigError, match="give either an EngineConfig or a model"):
        create_engine_config(str(qwen3_path), config=config)


def test_the_resolver_raises_the_engines_errors_before_any_engine(qwen3_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len=4096 exceeds the model's max_position_embeddings \(1024\)"):
        create_engine_config(str(qwen3_path), max_model_len=4096)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda' but no CUDA device is available"):
            create_engine_config(str(qwen3_path), device="cuda")


def test_llm_finishes_once_and_the_engine_core_runs_the_front_ends_config(
    qwen3_path: Path, finishes: list[str]
) -> None:
    with LLM(str(qwen3_path), **ENGINE) as llm:
        assert len(finishes) == 1
        core = llm.llm_engine.engine_client.engine
        assert core.config is llm.config and llm.config.finished
        assert (core.device.type, core.dtype) == (llm.config.device, getattr(torch, llm.config.dtype))
        assert core.attention_backend_name == llm.config.plugins.attention
        assert llm.max_model_len == core.config.max_model_len == 1024


def test_a_core_built_directly_finishes_its_own_config(qwen3_path: Path, finishes: list[str]) -> None:
    with ModelEngineCore(create_engine_config(str(qwen3_path), **ENGINE)) as core:
        assert core.config.finished and core.config.max_model_len == 1024 and len(finishes) == 1
        with ModelEngineCore(config=core.config) as second:  # as a replica is built: nothing is resolved again
            assert second.config is core.config and len(finishes) == 1


def test_serving_a_model_finishes_its_config_once_per_process(qwen3_path: Path, finishes: list[str]) -> None:
    pytest.importorskip("fastapi")
    from nanovllm_core.serving.api_server import ServerSettings, build_app
    from nanovllm_core.serving.async_llm import AsyncLLM

    async def serve(engine_process: bool) -> EngineConfig:
        engine = AsyncLLM.from_config(str(qwen3_path), engine_process=engine_process, **ENGINE)
        try:
            build_app(engine, ServerSettings(served_model_name="tiny"))
            await engine.start()
            return engine.config
        finally:
            await engine.shutdown()

    in_thread = asyncio.run(serve(engine_process=False))  # the front-end and the engine core in this process
    assert len(finishes) == 1 and in_thread.finished
    # the engine process's config (sent back when it is ready) is the front-end's finished one
    in_process = asyncio.run(serve(engine_process=True))
    assert len(finishes) == 2 and in_process.finished and in_process == in_thread
