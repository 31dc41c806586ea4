"""The elastic reward pool on a real in-process cluster with tagged workers: scale-up
under a burst, scale-down to zero, figures from the scheduler monitor, the pool backend
of serverless rewards (batching, time-outs, failure policy), an LLM judge on the pool,
and serverless rewards inside trajectories (failures counted by the ledger)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.tasks import Task
from rollart.reward import SERVERLESS, LLMJudge, RewardFailed, serverless
from rollart.reward.dispatch import RewardDispatcher
from rollart.reward.elastic import ElasticPool, pool_stats, reward_metrics, start_pools
from rollart.types import H20, H800, Episode

MAX = 2


def burst_task(seconds):
    time.sleep(seconds)
    from distributed import get_worker

    return get_worker().name


@serverless(max_workers=MAX, max_batch=4, batch_wait=0.05, timeout=20)
def on_elastic_worker(ep):
    """1.0 when it runs on a worker of the elastic pool (and nowhere else)."""
    from distributed import get_worker

    name = str(get_worker().name)
    if not name.startswith("elastic-"):
        raise RuntimeError(f"serverless reward ran on {name}")
    return 1.0 + len(ep.actions)


@serverless(max_workers=MAX, timeout=0.5, retries=1, backoff=0.05)
def hangs(ep):
    time.sleep(3)
    return 1.0


@serverless(max_workers=MAX, retries=2, backoff=0.01)
def always_raises(ep):
    raise ValueError("judge model unavailable")


@serverless(max_workers=MAX, retries=0, on_failure=0.25)
def raises_with_fallback(ep):
    raise ValueError("judge model unavailable")


def _ep(i: int = 0) -> Episode:
    return Episode("t", i, ["go :"] * (i + 1), ["up"] * i, [0.0] * i, {})


@pytest.fixture(scope="module")
def pool(local_cluster):
    p = ElasticPool(local_cluster.cluster, SERVERLESS, max_workers=MAX, interval=0.05,
                    wait_count=4).start(local_cluster)
    yield p
    p.stop()


def _wait_for_zero(client, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = pool_stats(client)
        if s["pool_size"] == 0 and s["demand"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError(f"the pool did not scale down to zero: {pool_stats(client)}")


def _score_all(reward, episodes):
    async def go():
        d = RewardDispatcher(reward)
        res = await asyncio.gather(*(d.score(e) for e in episodes), return_exceptions=True)
        return res, d

    return asyncio.run(go())


def test_scales_up_under_a_burst_and_down_to_zero(local_cluster, pool):
    c = local_cluster
    fixed = {w["name"] for w in c.scheduler_info(n_workers=-1)["workers"].values()}
    start = _wait_for_zero(c)
    t0, cold0 = time.time(), pool.cold_starts
    futs = [c.submit(burst_task, 0.4, resources={SERVERLESS: 1}, pure=False)
            for _ in range(8)]
    sizes = []
    while not all(f.done() for f in futs):
        sizes.append(pool_stats(c)["pool_size"])
        time.sleep(0.05)
    names = c.gather(futs)
    del futs
    assert all(n.startswith("elastic-serverless-") for n in names)
    assert max(sizes) == MAX  # scaled up to its maximum under the burst, never beyond
    end = _wait_for_zero(c)
    assert pool.cold_starts - cold0 >= MAX and pool.stats()["planned"] == 0
    assert end["cold_waits"] - start["cold_waits"] >= 1
    window = pool_stats(c, since=t0, series=True)
    assert window["busy_seconds"] >= 8 * 0.4 * 0.9
    assert 0 < window["busy_fraction"] <= 1.0
    assert window["worker_seconds"] >= window["busy_seconds"] / MAX
    assert window["series"][-1][1] == 0 and max(n for _, n in window["series"]) == MAX
    assert pool.cold_start_seconds and min(pool.cold_start_seconds) > 0
    now = {w["name"] for w in c.scheduler_info(n_workers=-1)["workers"].values()}
    assert fixed <= now  # the fixed pools were never scaled


def test_pool_backend_batches_onto_elastic_workers(local_cluster, pool):
    res, d = _score_all(on_elastic_worker, [_ep(i) for i in range(8)])
    assert res == [1.0 + i for i in range(8)]
    assert d.counts["batches"] < 8 and d.counts["done"] == 8 and d.counts["failed"] == 0
    _wait_for_zero(local_cluster)


def test_pool_backend_time_out_and_failure_policy(local_cluster, pool):
    res, d = _score_all(hangs, [_ep(0)])
    assert isinstance(res[0], RewardFailed) and "timeout=0.5" in str(res[0])
    assert d.counts["timeouts"] == 2 and d.counts["retries"] == 1
    res, d = _score_all(always_raises, [_ep(0), _ep(1)])
    assert all(isinstance(r, RewardFailed) for r in res)
    assert "judge model unavailable" in str(res[0]) and d.counts["failed"] == 2
    res, d = _score_all(raises_with_fallback, [_ep(0)])
    assert res == [0.25] and d.counts["fallbacks"] == 1
    _wait_for_zero(local_cluster, timeout=30)  # the hung task's worker is retired too


def test_llm_judge_on_the_pool(local_cluster, pool, tiny_model):
    judge = LLMJudge(tiny_model)
    reward = serverless(judge, max_workers=MAX, max_batch=8, batch_wait=0.05, timeout=60)
    eps = [_ep(i) for i in range(6)]
    res, d = _score_all(reward, eps)
    assert res == pytest.approx(judge.batch(eps), abs=1e-5)
    assert d.counts["batches"] <= 2


def test_start_pools_picks_the_pool_backend_rewards(local_cluster):
    plain = serverless(lambda ep: 1.0, backend="http", url="http://127.0.0.1:1/x")
    assert start_pools(local_cluster, [plain]) == []
    pools = start_pools(local_cluster, [on_elastic_worker, hangs], name="elastic-other",
                        interval=0.05)
    try:
        assert len(pools) == 1 and pools[0].maximum == MAX and pools[0].tag == SERVERLESS
    finally:
        for p in pools:
            p.stop()


# -- inside trajectories --------------------------------------------------------------
def _task(name, reward):
    return Task(name=name, env_factory=GridNavEnv, reward_fn=reward, max_turns=2)


@pytest.fixture(scope="module")
def manager(local_cluster, tiny_model, tmp_path_factory, pool, rollout_actors):
    mgr, buf, _ = rollout_actors(local_cluster, tiny_model,
                                 tmp_path_factory.mktemp("w") / "weights", "sl",
                                 pools=(H800, H20))
    return mgr, buf


def test_trajectories_score_on_the_elastic_pool(local_cluster, manager, pool):
    mgr, buf = manager
    summary = mgr.run_group(_task("elastic", on_elastic_worker), 3, "sl-ok", 4).result()
    assert "failed" not in summary["outcomes"]
    assert all(r >= 2.0 for r in summary["rewards"])  # ≥ 1 action, scored on the pool
    stats = mgr.stats().result()
    assert stats["reward/done"] >= 4 and stats["reward/batches"] <= stats["reward/requests"]
    row = reward_metrics(local_cluster, [pool], [mgr.stats().result()])
    assert row["reward/pool/cold_starts"] >= 1 and "reward/pool/busy_fraction" in row
    assert row["reward/latency_p50"] > 0
    assert len(buf.get_batch(1, min_version=-1, timeout=10).result()) == 4


def test_a_reward_failing_for_good_fails_the_trajectory(local_cluster, manager, pool):
    mgr, buf = manager
    before = buf.counts().result()
    summary = mgr.run_group(_task("failing", always_raises), 5, "sl-bad", 2).result()
    assert summary["outcomes"] == ["failed", "failed"]  # never a silent zero
    after = buf.counts().result()
    # each failed member is replaced once (at most group_size replacements per group) and
    # the replacements fail as well: 2 + 2, every one counted failed, none left in flight
    assert after["failed"] - before["failed"] == 4
    assert after["launched"] - before["launched"] == 4 and after["in_flight"] == 0
    # the run goes on: healthy trajectories still flow afterwards
    ok = mgr.run_group(_task("elastic", on_elastic_worker), 6, "sl-after", 2).result()
    assert "failed" not in ok["outcomes"]
    buf.get_batch(1, min_version=-1, timeout=10).result()


@pytest.fixture(scope="module")
def shipped_server():
    """``python -m rollart.reward.server`` as users start it, on 127.0.0.1."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "rollart.reward.server",
         "rollart.reward.functions:success_with_invalid_penalty=score",
         "tests.reward.test_elastic_pool:always_raises=broken", "--port", "0"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving ['broken', 'score'] at http://127.0.0.1:"), line
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow  # starts `python -m rollart.reward.server` (imports rollart: seconds)
def test_trajectories_score_through_the_shipped_function_server(manager, shipped_server):
    from rollart.reward import http_reward

    mgr, buf = manager
    remote = http_reward(f"{shipped_server}/score", max_batch=4, timeout=10)
    summary = mgr.run_group(_task("remote", remote), 7, "sl-http", 3).result()
    assert "failed" not in summary["outcomes"]
    trajs = buf.get_batch(1, min_version=-1, timeout=10).result()
    assert len(trajs) == 3 and {t.group_id for t in trajs} == {"sl-http"}
    stats = mgr.stats().result()
    assert stats["reward/done"] >= 3
    assert sorted(summary["rewards"]) == sorted(t.reward for t in trajs)
    # success (1/0) minus 0.1 per invalid action, computed by the endpoint
    assert all(r <= 1.0 and abs(r * 10 - round(r * 10)) < 1e-6 for r in summary["rewards"])
    broken = http_reward(f"{shipped_server}/broken", retries=1, backoff=0.01)
    before = buf.counts().result()["failed"]
    bad = mgr.run_group(_task("remote-bad", broken), 8, "sl-http-bad", 2).result()
    assert bad["outcomes"] == ["failed", "failed"]
    assert buf.counts().result()["failed"] - before == 4  # 2 members + their 2 replacements
