"""How a weight version reaches the workers in the simulator (rollart.sim.fanout): one
store node serving every worker a copy grows linearly in the workers; the trainer gang's
buckets relayed among the workers grow with the log of them, send about one copy from
the origins, and N ranks serve N times as fast. The ``store`` path keeps the single
store's figures (the 55 min a version of the 3,000-GPU run) and a run uses the path its
``WeightSync`` names."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rollart import GRPO, Graph, Policy
from rollart.chaos.faults import Latency
from rollart.sim import ClusterSpec, EnvPool, GPUPool, SimConfig, TaskShape, simulate
from rollart.sim.costs import MODELS, Costs, EnvCost, WeightSync
from rollart.sim.fanout import bucket_count, fan_out

# 16 buckets of 1 GB over 1 GB/s links, no latency: one round = 1 s
ROUND = WeightSync(latency_s=0.0, rdma_bytes_s=1e9, bucket_bytes=1e9)
STORE = replace(ROUND, path="store")
BYTES = 16e9


def test_relay_grows_with_the_log_of_the_pullers_the_store_linearly():
    """One origin, pullers with one link each: the store's one link carries K copies
    (16·K s); relayed, each puller needs its 16 rounds (its one link down) plus about
    log2(K) rounds for the copies to spread."""
    pullers = (2, 4, 16, 64, 256)
    relay = {k: fan_out(ROUND, BYTES, [1] * k).sync_s for k in pullers}
    store = {k: fan_out(STORE, BYTES, [1] * k).sync_s for k in pullers}
    for k in pullers:
        assert store[k] == pytest.approx(16 * k)
        assert 16 <= relay[k] <= 16 + 2 * math.log2(k)
    assert store[256] / store[2] == pytest.approx(128)
    assert relay[256] / relay[2] < 1.6  # 128 times the pullers
    # each doubling of the pullers adds at most about a round, never a copy's 16 s
    for a, b in zip(pullers, pullers[1:]):
        assert relay[b] - relay[a] <= 2 * math.log2(b / a)


def test_origins_send_one_copy_relayed_every_copy_from_the_store():
    for k in (1, 8, 100):
        relay, store = fan_out(ROUND, BYTES, [2] * k, 4), fan_out(STORE, BYTES, [2] * k)
        assert relay.delivered_bytes == store.delivered_bytes == BYTES * k
        assert relay.origin_bytes == pytest.approx(BYTES)
        assert relay.origin_ratio == pytest.approx(1 / k)
        assert store.origin_ratio == 1.0


def test_n_origin_ranks_divide_the_origin_time_by_n():
    """One puller with 16 links: from 1 rank it takes the 16 buckets one a round, from N
    ranks (bucket k on rank k mod N) N a round; the trainer's write divides alike."""
    one = fan_out(ROUND, BYTES, [16], ranks=1).sync_s
    for n in (2, 4, 8, 16):
        f = fan_out(ROUND, BYTES, [16], ranks=n)
        assert f.origins == n and f.sync_s == pytest.approx(one / n)
    assert fan_out(ROUND, BYTES, [16], ranks=64).origins == 16  # no more ranks than buckets
    m = MODELS["Qwen3-32B"]
    relay = WeightSync()
    assert relay.publish_s(m, 8) - relay.latency_s == pytest.approx(
        (relay.publish_s(m, 1) - relay.latency_s) / 8, rel=0.05)
    assert replace(relay, path="store").publish_s(m, 8) == relay.push_s(m)


def test_store_path_keeps_the_single_store_figures():
    """625 TP-4 Qwen3-32B workers (the 3,000-GPU run) from one store node at the assumed
    12.5 GB/s: 41 TB a version, 3,280 s (the 55 min of docs/benchmarks/cluster-sim.md);
    one TP-1 worker alone: ``WeightSync.pull_s``, as before the relay. Relayed from 500
    ranks the same version takes under 2 s (origins: 245 ranks, one per bucket)."""
    m, store = MODELS["Qwen3-32B"], WeightSync(path="store")
    f = fan_out(store, m.weight_bytes, [4] * 625, ranks=500)
    assert f.sync_s == pytest.approx(625 * m.weight_bytes / 12.5e9 + 0.05, rel=1e-6)
    assert 54 * 60 < f.sync_s < 56 * 60 and f.origin_ratio == 1.0
    assert fan_out(store, m.weight_bytes, [1]).sync_s == pytest.approx(store.pull_s(m))
    relay = fan_out(WeightSync(), m.weight_bytes, [4] * 625, ranks=500)
    assert relay.origins == bucket_count(m.weight_bytes, 256 * 2 ** 20) == 245
    assert relay.sync_s < 2.0 and relay.origin_ratio == pytest.approx(1 / 625)
    with pytest.raises(ValueError, match="'relay'.*'store'"):
        WeightSync(path="tree")


def _lockstep(path: str):
    """sync mode, 2 steps, 8 H20 workers of Qwen3-8B: between the steps every worker
    loads version 1 with rollout stopped, so the second step starts after the path's
    sync time."""
    graph = Graph(name="w", tasks=("gridnav",), mode="sync", steps=2,
                  policy=Policy(warmup_steps=0), algo=GRPO(group_size=2, groups_per_step=2))
    env = EnvCost("fixed", reset=Latency("fixed", 1.0), step=Latency("fixed", 0.5))
    costs = Costs(model=MODELS["Qwen3-8B"], env={"*": env},
                  weights=WeightSync(path=path))
    cluster = ClusterSpec((GPUPool("H20", "H20", 8),), (EnvPool("CPU_ENV", 64),),
                          trainer_gpus=8)
    shape = TaskShape(turns=2, prompt_tokens=64, obs_tokens=16, response_tokens=16)
    return simulate(SimConfig(cluster, graph, costs, shapes={"gridnav": shape}, steps=2))


def test_a_run_uses_the_path_its_weight_sync_names():
    """The same lockstep run through the store and through the relay differs by the
    first version's sync times (8 copies through one 12.5 GB/s link: 10.5 s, against
    ~1.4 s relayed), and each reports its path's sync time and origin bytes."""
    store, relay = _lockstep("store"), _lockstep("relay")
    w = MODELS["Qwen3-8B"].weight_bytes
    assert store.extra["weight_path"] == "store" and relay.extra["weight_path"] == "relay"
    s, r = store.extra["weight_sync_s"][0], relay.extra["weight_sync_s"][0]
    assert s == pytest.approx(8 * w / 12.5e9 + 0.05, rel=1e-6)
    assert r < s / 5
    assert store.extra["origin_bytes_ratio"] == 1.0
    assert relay.extra["origin_bytes_ratio"] == pytest.approx(1 / 8)
    # the trainer's write differs too: one copy to the store, 1/8 a rank relayed
    ws = WeightSync()
    write = replace(ws, path="store").publish_s(MODELS["Qwen3-8B"]) - \
        ws.publish_s(MODELS["Qwen3-8B"], 8)
    assert store.sim_time_s - relay.sim_time_s == pytest.approx(s - r + 2 * write,
                                                                rel=1e-3)
