"""The data-parallel router (least loaded, with prefix-cache affinity) and the Ray backend's settings; no engine."""

from __future__ import annotations

import sys

import pytest
from nanovllm_data_parallel.router import CHARS_PER_TOKEN, Router

from nanovllm_core import ConfigError, EngineConfig
from nanovllm_core.engine.config_resolver import finish_config
from nanovllm_core.errors import UnknownPluginError


def prompt(prefix: int, suffix: int, chunks: int = 3, chunk: int = 16) -> list[int]:
    return [prefix] * (chunks * chunk) + [suffix] * 5


def test_chunk_hashes_are_chained_over_full_chunks_of_ids_or_text():
    router = Router(2, chunk_tokens=4)
    assert router.chunk_hashes([1, 2, 3]) == [] and router.chunk_hashes({"x": 1}) == []
    a, b = router.chunk_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), router.chunk_hashes([1, 2, 3, 4, 5, 6, 7, 0])
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    # a chunk's hash stands for the whole prefix: the same chunk after another first chunk hashes differently
    assert router.chunk_hashes([0, 0, 0, 0, 5, 6, 7, 8])[1] != a[1]
    text = "x" * (4 * CHARS_PER_TOKEN * 2 + 3)
    assert len(router.chunk_hashes(text)) == 2 and router.chunk_hashes(text) != router.chunk_hashes([120] * 8)


def test_least_loaded_without_a_shared_prefix():
    router = Router(3)
    router.loads[:] = [50, 10, 30]
    assert router.route([7] * 40) == 1
    assert router.route([1, 2, 3], up=[True, False, True]) == 2
    with pytest.raises(RuntimeError, match="every one is down"):
        router.route([1], up=[False, False, False])


def test_a_shared_prefix_goes_where_it_was_sent_until_that_replica_is_overloaded():
    router = Router(2, balance_abs_tokens=100, balance_rel=1.5)
    assert router.route(prompt(1, 0)) == 0
    router.loads[0] = 90  # busier, but within the allowance: affinity wins
    assert router.route(prompt(1, 2)) == 0
    assert router.route(prompt(2, 0)) == 1  # another prefix: the least loaded
    router.loads[:] = [300, 50]  # 250 over the least and 6x: overloaded, the prefix spills over
    assert router.route(prompt(1, 3)) == 1
    router.loads[:] = [60, 60]  # both hold it now: the less loaded of them
    router.loads[0] = 59
    assert router.route(prompt(1, 4)) == 0
    router.loads[:] = [500, 450]  # 50 over: not overloaded however large the loads
    assert router.route(prompt(2, 9)) == 1


def test_the_longest_matching_prefix_wins_and_forget_drops_a_replica():
    router = Router(2, chunk_tokens=4)
    assert router.route([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 0  # three chunks on 0
    router.loads[:] = [10_000, 0]
    assert router.route([1, 2, 3, 4, 0]) == 1  # overloaded: the first chunk now on 1 as well
    router.loads[:] = [20, 10]
    longer = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    assert [router.matched_chunks(r, router.chunk_hashes(longer)) for r in (0, 1)] == [3, 1]
    assert router.route(longer) == 0  # three chunks beat one, though 0 is busier
    router.forget(0)  # replica 0 restarted: its cache is empty
    assert router.matched_chunks(0, router.chunk_hashes(longer)) == 0
    assert router.route(longer) == 1


def test_the_policies_to_compare_with():
    router = Router(2, policy="least_loaded")
    router.route(prompt(1, 0))
    router.loads[0] = 1
    assert router.route(prompt(1, 0)) == 1  # the prefix is on 0: only loads count
    turns = Router(3, policy="round_robin")
    turns.loads[:] = [0, 100, 0]
    assert [turns.route(prompt(1, i)) for i in range(4)] == [0, 1, 2, 0]
    assert turns.route([1], up=[False, True, False]) == 1 and turns.route([1], up=[True, False, True]) == 2
    with pytest.raises(ValueError, match="routing policy 'random' is unknown; choose from cache_aware, least_loaded"):
        Router(2, policy="random")


def test_cache_is_bounded_least_recently_used_first():
    router = Router(1, chunk_tokens=1, max_chunks_per_replica=3)
    router.route([1, 2, 3])
    router.route([9])
    assert router.matched_chunks(0, router.chunk_hashes([1, 2, 3])) == 0  # its first chunk went first
    assert router.matched_chunks(0, router.chunk_hashes([9])) == 1


def test_ray_settings_and_their_errors(monkeypatch):
    config = EngineConfig(model="m")
    assert (config.data_parallel_backend, config.ray_address, config.ray_num_gpus_per_replica) == ("mp", None, None)
    dask = EngineConfig.load(overrides={"model": "m", "data_parallel_size": 2, "data_parallel_backend": "dask"})
    with pytest.raises(UnknownPluginError, match="no data parallel backend named 'dask' is installed"):
        finish_config(dask)
    with pytest.raises(ConfigError, match="needs tensor_parallel_size 1"):
        EngineConfig.load(overrides={"model": "m", "ray_num_gpus_per_replica": 0.5, "tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="fewer GPUs than tensor_parallel_size=4 needs; allowed: at least 4"):
        EngineConfig.load(overrides={"model": "m", "ray_num_gpus_per_replica": 2, "tensor_parallel_size": 4})
    assert EngineConfig.load(overrides={"model": "m", "ray_num_gpus_per_replica": 2}).ray_num_gpus_per_replica == 2
    # two replicas sharing one GPU
    assert EngineConfig.load(overrides={"model": "m", "ray_num_gpus_per_replica": 0.5}).ray_num_gpus_per_replica == 0.5

    from nanovllm_core.cli import build_parser, cli_overrides

    flags = ["--data-parallel-backend", "ray", "--ray-address", "auto", "--ray-num-gpus-per-replica", "0.5"]
    args = build_parser().parse_args(["generate", "--model", "m", "-dp", "2", *flags])
    overrides = cli_overrides(args)
    assert (overrides["data_parallel_backend"], overrides["ray_address"]) == ("ray", "auto")
    assert overrides["ray_num_gpus_per_replica"] == 0.5

    from nanovllm_core.engine_client.factory import make_engine_client

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    ray_config = EngineConfig(model="m", data_parallel_size=2, data_parallel_backend="ray")
    with pytest.raises(ConfigError, match=r'needs the ray package.*pip install "nanovllm-data-parallel\[ray\]"'):
        make_engine_client(ray_config)
