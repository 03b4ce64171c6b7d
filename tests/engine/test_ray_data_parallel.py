"""Data-parallel replicas on Ray (``data_parallel_backend="ray"``): a local Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``, one CPU each), one replica actor per node, the tiny checkpoint on CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

# the submodule the test needs: a folder named ray on sys.path would pass for the package itself
cluster_utils = pytest.importorskip("ray.cluster_utils")
import ray  # noqa: E402
from engine_helpers import GREEDY, PROMPTS, make_prompts, pid_running  # noqa: E402
from nanovllm_data_parallel.ray_client import RayDataParallelClient  # noqa: E402

from nanovllm_core import LLM, EngineConfig, SamplingParams  # noqa: E402
from nanovllm_core.errors import UnknownPluginError  # noqa: E402

pytestmark = pytest.mark.ray

ENGINE = dict(device="cpu", num_kvcache_blocks=128, kvcache_block_size=16, max_model_len=512)
MIXED = PROMPTS + make_prompts(1, [9, 30, 55]) + ["Hello world!", "The quick brown fox"]
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # still running when the kill lands
REJOIN_S = 90.0
# Ray checks a node's health every 0.2 s, not every three: a removed node (its checks refused at once) is found dead
# after five failed checks in a row in about 1 s, not 15. A node that is slow to answer is not found dead sooner: each
# check still waits its default 10 s for the answer before the next one starts
SYSTEM_CONFIG = {"health_check_period_ms": 200}


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": SYSTEM_CONFIG}
    )
    cluster.add_node(num_cpus=1)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def single(qwen3_path):
    llm = LLM(str(qwen3_path), **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mixed_want(single) -> list[list[int]]:
    """The one engine's greedy tokens for MIXED: what every data-parallel run of it must give."""
    return token_ids(single.generate(MIXED, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def dp(qwen3_path, cluster):
    llm = LLM(str(qwen3_path), data_parallel_size=2, data_parallel_backend="ray", ray_address=cluster.address, **ENGINE)
    yield llm
    llm.shutdown()


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def actors() -> list[dict]:
    """Every actor the cluster's control store knows. ``ray.util.state`` would ask the dashboard, which the plain
    ``ray`` package (the ``ray`` extra) does not install."""
    return list(ray._private.state.actors().values())


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def kill_replica(client: RayDataParallelClient, r: int) -> int:
    """SIGKILL replica r's actor process (its node is this machine); its pid."""
    pid = client.replica_pids[r]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_outputs_equal_one_engine_with_one_replica_on_each_node(dp, mixed_want):
    client = dp.engine_client
    assert isinstance(client, RayDataParallelClient) and dp.config.data_parallel_size == 2
    outs = dp.generate(MIXED, GREEDY, use_tqdm=False)
    assert token_ids(outs) == mixed_want
    assert outs[-1].prompt == "The quick brown fox" and all(o.error is None for o in outs)
    stats = dp.replica_stats()
    assert all(s.num_finished_requests > 0 for s in stats) and sum(s.num_finished_requests for s in stats) == len(MIXED)
    assert dp.stats().num_kv_blocks == 2 * ENGINE["num_kvcache_blocks"]
    replicas = [a for a in actors() if a["State"] == "ALIVE" and a["ActorClassName"] == "ReplicaActor"]
    nodes = {a["Address"]["NodeID"] for a in replicas}
    assert len(nodes) == 2  # SPREAD: one replica per node


def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(dp):
    prefix_a, prefix_b = make_prompts(7, [48, 48])
    suffixes = make_prompts(8, [8] * 4)
    group_a = [prefix_a + s for s in suffixes]
    group_b = [prefix_b + s for s in suffixes]
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    dp.generate([group_a[0], group_b[0]], short, use_tqdm=False)  # each prefix now cached on one replica
    before = dp.stats()
    dp.generate(group_a[1:] + group_b[1:], short, use_tqdm=False)
    after = dp.stats()
    # every later request found its whole 48-token prefix (three blocks) cached: it went where its prefix is
    assert after.prefix_cache_hits - before.prefix_cache_hits == 6 * 48


class KillingBar:
    """generate's progress bar: its first update (the short request finished) kills replica 1, whose long requests
    are still running then."""

    def __init__(self, client: RayDataParallelClient, killed: list) -> None:
        self.client, self.killed = client, killed

    def __call__(self, *args, **kwargs) -> KillingBar:
        return self

    def update(self, n: int = 1) -> None:
        if not self.killed:
            in_flight = sum(o.replica == 1 for o in list(self.client._owners.values()))
            self.killed.append((kill_replica(self.client, 1), in_flight))

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_replica_killed_mid_generate_costs_no_request_and_rejoins(dp, single, mixed_want, monkeypatch):
    from nanovllm_core.entrypoints import llm as llm_module

    client = dp.engine_client
    prompts = [[5, 6, 7]] + make_prompts(3, [20, 31, 42, 25, 36, 47])
    params = [SamplingParams(temperature=0, max_tokens=1)] + [LONG] * 6
    before = dp.replica_stats()
    killed: list = []
    monkeypatch.setattr(llm_module, "tqdm", KillingBar(client, killed))
    outs = dp.generate(prompts, params)
    monkeypatch.undo()
    assert killed and killed[0][1] > 0  # requests were running on the replica when it died
    want = token_ids(single.generate(prompts, params, use_tqdm=False))  # here, while replica 1 restarts
    # the dead replica's requests had shown no token (generate returns whole outputs): they ran on the other
    assert all(o.error is None for o in outs) and token_ids(outs) == want
    assert wait_for(lambda: all(client.replicas_up), REJOIN_S), "replica 1 did not rejoin"
    assert client.replica_pids[1] != killed[0][0] and not pid_running(killed[0][0])
    again = dp.generate(MIXED, GREEDY, use_tqdm=False)
    assert token_ids(again) == mixed_want
    after = dp.replica_stats()
    assert after[1].num_finished_requests > 0  # the restarted replica serves (its counters started again)
    assert after[0].num_finished_requests > before[0].num_finished_requests


def test_shutdown_leaves_no_actor_placement_group_or_process(dp, cluster):
    client = dp.engine_client
    pids = list(client.replica_pids)
    start = time.monotonic()
    dp.shutdown()
    assert time.monotonic() - start < 15
    assert not ray.is_initialized()  # this client started the connection: it shut it down
    assert wait_for(lambda: not [p for p in pids if pid_running(p)], 10)
    assert_nothing_left(cluster)
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        dp.generate(PROMPTS, GREEDY, use_tqdm=False)


def assert_nothing_left(cluster) -> None:
    """No actor alive (or restarting) in the cluster, and every placement group removed."""
    ray.init(address=cluster.address)
    try:
        assert wait_for(lambda: all(a["State"] == "DEAD" for a in actors()), 10)
        assert {pg["state"] for pg in ray.util.placement_group_table().values()} <= {"REMOVED"}
    finally:
        ray.shutdown()


def test_a_replica_that_cannot_start_is_named_and_nothing_is_left(qwen3_path, cluster):
    with pytest.raises(UnknownPluginError, match=r"replica \d \(Ray actor\) failed to start: .*no scheduler named 'x'"):
        LLM(str(qwen3_path), data_parallel_size=2, data_parallel_backend="ray", ray_address=cluster.address,
            plugins={"scheduler": "x"}, **ENGINE)  # fmt: skip
    assert not ray.is_initialized()
    assert_nothing_left(cluster)


def test_a_replica_without_restarts_left_leaves_the_others_serving(qwen3_path, cluster, mixed_want):
    llm = LLM(str(qwen3_path), data_parallel_size=2, data_parallel_backend="ray", ray_address=cluster.address,
              ray_max_restarts=0, **ENGINE)  # fmt: skip
    try:
        client = llm.engine_client
        want = mixed_want
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == want
        kill_replica(client, 0)
        assert wait_for(lambda: client.replicas_up == [False, True], 30)
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == want  # replica 1 alone
        stats = llm.replica_stats()
        assert stats[0] is None and stats[1].num_finished_requests >= len(MIXED)
        assert llm.stats().num_kv_blocks == ENGINE["num_kvcache_blocks"]  # the one serving
        kill_replica(client, 1)
        assert wait_for(lambda: client.failure is not None, 30)
        with pytest.raises(RuntimeError, match="every data-parallel replica is gone"):
            llm.generate(MIXED, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_nothing_left(cluster)


def test_a_replica_killed_mid_stream_fails_its_streams_only(qwen3_path, cluster, single):
    from nanovllm_core.serving.async_llm import AsyncLLM

    prompts = make_prompts(5, [12, 23, 34, 45])
    # long enough to be running at the kill, which follows every stream's first token (they had shown 1-4 then)
    stream = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    delta = dataclasses.replace(stream, output_kind="delta")
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind="delta")

    async def main():
        config = EngineConfig(
            model=str(qwen3_path), data_parallel_size=2, data_parallel_backend="ray", ray_address=cluster.address,
            **ENGINE,
        )  # fmt: skip
        core = RayDataParallelClient(config)
        owners, got, errors = {}, {}, {}
        async with AsyncLLM(core) as llm:
            streams = [await llm.add_request(p, delta, f"s{i}") for i, p in enumerate(prompts)]
            owners = {f"s{i}": core._owners[f"s{i}"].replica for i in range(len(prompts))}
            first = [await s.__anext__() for s in streams]  # every stream has shown a token
            for i, out in enumerate(first):
                got[f"s{i}"] = list(out.outputs[0].token_ids)
            victim = kill_replica(core, 1)
            for i, s in enumerate(streams):
                async for out in s:
                    got[f"s{i}"] += out.outputs[0].token_ids
                    if out.error:
                        errors[f"s{i}"] = out.error
            # the one engine's tokens meanwhile, while replica 1 restarts
            rejoined, want = await asyncio.gather(
                asyncio.to_thread(wait_for, lambda: all(core.replicas_up), REJOIN_S),
                asyncio.to_thread(lambda: token_ids(single.generate(prompts, stream, use_tqdm=False))),
            )
            later = [o async for o in llm.generate(prompts[0], short, "after")]
        return core, owners, got, errors, victim, rejoined, later, want

    core, owners, got, errors, victim, rejoined, later, want = asyncio.run(asyncio.wait_for(main(), 150))
    on_victim = {rid for rid, r in owners.items() if r == 1}
    assert on_victim and len(on_victim) < len(prompts)
    assert set(errors) == on_victim, {rid: len(tokens) for rid, tokens in got.items()}  # a victim done before the kill?
    assert all(e.startswith("data-parallel replica 1 (Ray actor on node") and "died" in e for e in errors.values())
    for i in range(len(prompts)):
        if f"s{i}" not in on_victim:
            assert got[f"s{i}"] == want[i]
    assert rejoined and sum(len(o.outputs[0].token_ids) for o in later) == short.max_tokens
    assert not pid_running(victim) and not core.alive


def test_a_replica_whose_node_goes_away_is_placed_again_on_another(qwen3_path, cluster, mixed_want):
    """A third node joins; the two replicas spread over two of the three. The worker node under one of them is
    removed: its requests complete on the other replica, and Ray places the lost bundle on the node left free, where
    the replica starts again and rejoins. The cluster ends as it began: a head and one worker node."""
    spare = cluster.add_node(num_cpus=1)
    llm = LLM(str(qwen3_path), data_parallel_size=2, data_parallel_backend="ray", ray_address=cluster.address, **ENGINE)
    try:
        client = llm.engine_client
        want = mixed_want
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == want
        on_node = {a["Pid"]: a["Address"]["NodeID"] for a in actors() if a["State"] == "ALIVE"}
        replica_nodes = [on_node[pid] for pid in client.replica_pids]
        workers = {node.node_id: node for node in cluster.worker_nodes}
        r = next(i for i, node_id in enumerate(replica_nodes) if node_id in workers)
        gone = workers[replica_nodes[r]]
        cluster.remove_node(gone, allow_graceful=False)
        assert wait_for(lambda: not client.replicas_up[r], 30), "the replica on the removed node stayed in the routing"
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == want  # the other replica serves them all
        assert wait_for(lambda: all(client.replicas_up), REJOIN_S), f"replica {r} was not placed again"
        on_node = {a["Pid"]: a["Address"]["NodeID"] for a in actors() if a["State"] == "ALIVE"}
        assert on_node[client.replica_pids[r]] not in (gone.node_id, replica_nodes[1 - r])
        assert token_ids(llm.generate(MIXED, GREEDY, use_tqdm=False)) == want
        assert llm.replica_stats()[r].num_finished_requests > 0  # the replica placed again serves
    finally:
        llm.shutdown()
        if spare is not gone and spare in cluster.worker_nodes:
            cluster.remove_node(spare)  # keep the module's two-node cluster for the tests after this one
    assert_nothing_left(cluster)
