"""Envs that raise, hang or return garbage, on a real in-process tagged cluster: each
such trajectory fails with a message naming the cause, is counted in the ledger and
replaced by a new member; hung sync calls give their threads back (none leaked), and a
whole-episode time-out cuts slow-but-alive episodes."""

import asyncio
import threading
import time

import pytest

from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.manager import EnvManager
from rollart.env.tasks import Task
from rollart.reward import success_reward
from rollart.rollout import LLMProxy
from rollart.testing import unique_key
from rollart.types import CPU_ENV, H20, H800


class HangUntilClosed(GridNavEnv):
    """Sync step that blocks its thread until ``close()`` (a wedged sandbox)."""

    def __init__(self):
        super().__init__()
        self._closed = threading.Event()

    def step(self, action):
        if not self._closed.wait(30):
            raise RuntimeError("never released")
        raise RuntimeError("released by close")

    def close(self):
        self._closed.set()


class SlowButAlive(GridNavEnv):
    """Each step well under the step time-out; together far over a trajectory's."""

    def __init__(self):
        super().__init__(max_turns=50)

    async def astep(self, action):
        # at most two steps fit in the 1 s trajectory time-out (at 0.15 s a step an
        # episode once ended "truncated" before the time-out fired; cause not pinned)
        await asyncio.sleep(0.4)
        return self.step("jump")


class Garbage(GridNavEnv):
    def step(self, action):
        return ["not", "a", "step"]


class FlakyFirst(GridNavEnv):
    """Every other instance (1st, 3rd, ...) crashes on its first step."""

    made = 0

    def __init__(self):
        super().__init__()
        FlakyFirst.made += 1
        self.bad = FlakyFirst.made % 2 == 1

    def step(self, action):
        if self.bad:
            raise ConnectionError("sandbox went away")
        return super().step(action)


def _task(name, env, max_turns=3):
    return Task(name=name, env_factory=env, reward_fn=success_reward, max_turns=max_turns)


@pytest.fixture(scope="module")
def setup(local_cluster, tiny_model, tmp_path_factory, rollout_actors):
    c = local_cluster
    mgr, buf, workers = rollout_actors(c, tiny_model, tmp_path_factory.mktemp("w") / "weights",
                                       "rel", pools=(H800, H20), env_step_timeout=0.3,
                                       env_threads=2)
    timed = c.submit(EnvManager, LLMProxy(workers), buf, tiny_model, trajectory_timeout=1.0,
                     actor=True, resources={CPU_ENV: 1}, key=unique_key("rel-mgr-timed")).result()
    return c, mgr, buf, timed


_OLD_THREADS: set = set()


@pytest.fixture(scope="module", autouse=True)
def _threads_before():
    """Threads other test modules left behind are not this module's to count."""
    _OLD_THREADS.update(t.ident for t in threading.enumerate())


def _env_threads():
    return [t.name for t in threading.enumerate()
            if t.name.startswith("rollart-env") and t.ident not in _OLD_THREADS]


def test_hung_sync_envs_fail_and_give_their_threads_back(setup):
    c, mgr, buf, _ = setup
    before = buf.counts().result()
    # 4 members (and their replacements) on 2 env threads: without closing hung envs at
    # once, the pool would stay wedged and later members could never step
    t0 = time.perf_counter()
    out = mgr.run_group(_task("hang", HangUntilClosed), 1, "hang", 4).result(timeout=60)
    assert out["outcomes"] == ["failed"] * 4
    assert time.perf_counter() - t0 < 20
    deadline = time.time() + 5
    while mgr.stats().result()["stuck_env_calls"] and time.time() < deadline:
        time.sleep(0.05)
    assert mgr.stats().result()["stuck_env_calls"] == 0  # every hung call returned
    pool = [n for n in _env_threads() if n.startswith("rollart-env_")]
    assert len(pool) <= 2 + 2  # the pools of this manager and the plain one: bounded
    assert not [n for n in _env_threads() if n == "rollart-env-close"]
    after = buf.counts().result()
    # 4 replaced (failed, then a new member), then 4 delivered failed: 8 failures
    assert after["failed"] - before["failed"] == 8
    assert after["launched"] - before["launched"] == 8 and after["in_flight"] == 0


def test_trajectory_timeout_cuts_a_slow_episode(setup):
    c, _, buf, mgr = setup
    out = mgr.run_group(_task("slow", SlowButAlive, max_turns=50), 2, "slow", 2).result(
        timeout=60)
    assert out["outcomes"] == ["failed", "failed"]
    batch = buf.counts().result()
    assert batch["in_flight"] == 0


def test_garbage_and_flaky_envs_are_counted_and_replaced(setup):
    c, mgr, buf, _ = setup
    before, started = buf.counts().result(), mgr.stats().result()
    out = mgr.run_group(_task("junk", Garbage), 3, "junk", 2).result(timeout=60)
    assert out["outcomes"] == ["failed", "failed"]
    out = mgr.run_group(_task("flaky", FlakyFirst), 4, "flaky", 4).result(timeout=60)
    assert "failed" not in out["outcomes"]  # each failed member was replaced by a good one
    after = buf.counts().result()
    stats = mgr.stats().result()
    # junk: 2 failed, replaced, 2 more failed and delivered (replacements used up);
    # flaky: odd instances crash, each is replaced, until 4 good ones (2, 4, 6, 8)
    # are delivered: 1, 3, 5, 7 failed (4 replacements, the most a group of 4 gets)
    assert stats["replaced"] >= 2 + 4
    assert after["failed"] - before["failed"] == 4 + 4
    assert after["launched"] - before["launched"] == 4 + 8
    # the ledger against the manager's own counts of the members it started and of those
    # that failed (replaced or delivered): 2 + 4 delivered
    assert stats["launched"] - started["launched"] == after["launched"] - before["launched"]
    assert stats["failed"] - started["failed"] == after["failed"] - before["failed"]
    assert stats["delivered"] - started["delivered"] == 2 + 4
