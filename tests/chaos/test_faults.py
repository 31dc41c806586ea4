"""Fault injection (rollart.chaos.faults): latency distributions, validation, reproducible
decisions, failures, hangs (async and sync), start-up delay, and the task wrapper."""

from __future__ import annotations

import asyncio
import pickle
import random
import statistics
import threading
import time
from dataclasses import replace

import pytest

from rollart.env.builtin.gridnav import GridNavEnv
from rollart.chaos.faults import (
    Faults,
    FaultyEnv,
    FaultyEnvFactory,
    InjectedFault,
    Latency,
    none,
    plan_step,
    straggler_profile,
    with_faults,
)
from rollart.env.tasks import BUILTIN_TASKS, Task, get_task


# -- Latency ----------------------------------------------------------------------------
def test_fixed_latency_is_exact():
    rng = random.Random(0)
    assert {Latency("fixed", seconds=0.25).sample(rng) for _ in range(50)} == {0.25}
    assert Latency("fixed", seconds=3.0, cap=1.0).sample(rng) == 1.0


def test_lognormal_median_near_seconds():
    lat, rng = Latency("lognormal", seconds=0.02, sigma=1.0), random.Random(1)
    xs = [lat.sample(rng) for _ in range(2000)]
    assert min(xs) > 0
    assert 0.017 < statistics.median(xs) < 0.023
    assert max(xs) > 5 * statistics.median(xs)  # sigma 1 spreads samples over decades


def test_pareto_minimum_heavy_tail_and_cap():
    lat, rng = Latency("pareto", seconds=0.05, shape=1.2), random.Random(2)
    xs = [lat.sample(rng) for _ in range(2000)]
    assert min(xs) >= 0.05
    assert max(xs) / statistics.median(xs) > 50
    capped = Latency("pareto", seconds=0.05, shape=1.2, cap=2.0)
    ys = [capped.sample(rng) for _ in range(2000)]
    assert max(ys) == 2.0 and min(ys) >= 0.05


def test_zero_seconds_gives_zero_for_every_kind():
    rng = random.Random(0)
    for kind in ("fixed", "lognormal", "pareto"):
        assert Latency(kind).sample(rng) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "normal"}, "unknown; use one of fixed, lognormal, pareto"),
    ({"kind": "fixed", "seconds": -1.0}, "use a value >= 0"),
    ({"kind": "lognormal", "seconds": 1.0, "sigma": 0.0}, "sigma is 0.0; use a value > 0"),
    ({"kind": "pareto", "seconds": 1.0, "shape": -2.0}, "shape is -2.0; use a value > 0"),
    ({"kind": "fixed", "cap": -0.5}, "cap is -0.5; use a value >= 0 or None"),
    ({"kind": "fixed", "seconds": float("nan")}, "finite number"),
])
def test_latency_validation_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Latency(**kwargs)


# -- Faults -----------------------------------------------------------------------------
def test_faults_float_shorthand_and_profiles():
    f = Faults(startup=0.5, step=0.01)
    assert f.startup == Latency("fixed", seconds=0.5)
    assert f.step == Latency("fixed", seconds=0.01)
    assert none() == Faults() and none().step is None
    s = straggler_profile(seed=3)
    assert s.step.kind == "lognormal" and s.step.seconds == pytest.approx(0.02)
    assert s.startup.kind == "pareto" and s.startup.cap == pytest.approx(2.0)
    assert s.seed == 3 and s.fail_prob == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"fail_prob": 1.5}, "fail_prob is 1.5; use a probability in"),
    ({"hang_prob": -0.1}, "hang_prob is -0.1; use a probability in"),
    ({"fail_prob": 0.6, "hang_prob": 0.6}, "lower them so their sum is <= 1"),
    ({"step": -0.1}, "Faults.step is -0.1; use a delay >= 0"),
    ({"hang_seconds": -1}, "hang_seconds is -1; use a value >= 0"),
    ({"hang_seeds": 5}, "hang_seeds must be episode seeds"),
    ({"fail_seeds": ("7",)}, "fail_seeds must be episode seeds"),
    ({"fail_seeds": (3, 4), "hang_seeds": [4]}, "share \\[4\\]"),
])
def test_faults_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Faults(**kwargs)


def test_decisions_reproducible_per_seed_and_turn():
    f = Faults(step=Latency("lognormal", seconds=0.02), fail_prob=0.3, hang_prob=0.2, seed=7)
    plans = [plan_step(f, 11, t) for t in range(1, 200)]
    assert plans == [plan_step(f, 11, t) for t in range(1, 200)]
    assert plans != [plan_step(replace(f, seed=8), 11, t) for t in range(1, 200)]
    fails, hangs = sum(p.fail for p in plans), sum(p.hang for p in plans)
    assert 30 < fails < 90 and 15 < hangs < 65 and not any(p.fail and p.hang for p in plans)


def test_named_seeds_fail_or_hang_on_their_first_step_in_every_instance():
    """``fail_seeds`` / ``hang_seeds``: the first step of those episodes, whatever the
    instance (the members of a group and their replacements); other steps and seeds
    follow the probabilities (none here)."""
    f = Faults(fail_seeds=[11], hang_seeds=(12,), seed=5)
    assert f.fail_seeds == (11,)  # a list is kept as a tuple: Faults stays hashable
    for instance in range(4):
        assert plan_step(f, 11, 1, instance).fail and not plan_step(f, 11, 1, instance).hang
        assert plan_step(f, 12, 1, instance).hang and not plan_step(f, 12, 1, instance).fail
        assert not any(plan_step(f, 11, t, instance).fail or plan_step(f, 12, t, instance).hang
                       for t in range(2, 6))
        assert not any(plan_step(f, 13, t, instance).fail or plan_step(f, 13, t, instance).hang
                       for t in range(1, 6))
    env = FaultyEnv(GridNavEnv(), replace(f, hang_seconds=0.05))
    env.reset(12)
    with pytest.raises(InjectedFault, match="injected hang of 0.05s at turn 1"):
        env.step("up")
    env.reset(11)
    with pytest.raises(InjectedFault, match="injected failure at turn 1 of episode seed 11"):
        env.step("up")


def test_env_failures_follow_the_plan_in_both_paths():
    f = Faults(fail_prob=0.5, seed=1)
    expected = [plan_step(f, 4, t).fail for t in range(1, 9)]
    assert any(expected) and not all(expected)

    def run_sync():
        env, out = FaultyEnv(GridNavEnv(max_turns=50), f), []
        env.reset(4)
        for _ in range(8):
            try:
                env.step("up")
                out.append(False)
            except InjectedFault:
                out.append(True)
        return out, env.injected_failures

    async def run_async():
        env, out = FaultyEnv(GridNavEnv(max_turns=50), f), []
        await env.areset(4)
        for _ in range(8):
            try:
                await env.astep("up")
                out.append(False)
            except InjectedFault:
                out.append(True)
        return out

    out, count = run_sync()
    assert out == expected and count == sum(expected)
    assert asyncio.run(run_async()) == expected


# -- failures and hangs -----------------------------------------------------------------
def test_fail_prob_one_raises_injected_fault():
    env = FaultyEnv(GridNavEnv(), Faults(fail_prob=1.0))
    env.reset(0)
    with pytest.raises(InjectedFault, match="injected failure at turn 1"):
        env.step("up")
    assert env.injected_failures == 1 and isinstance(InjectedFault("x"), RuntimeError)


def test_async_hang_times_out_promptly_without_a_thread():
    async def main():
        env = FaultyEnv(GridNavEnv(), Faults(hang_prob=1.0, hang_seconds=30.0))
        await env.areset(0)
        threads = threading.active_count()
        t0 = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.astep("up"), 0.1)
        assert threading.active_count() == threads
        return time.perf_counter() - t0, env.injected_hangs

    elapsed, hangs = asyncio.run(main())
    assert elapsed < 1.0 and hangs == 1


def test_async_hang_released_by_close_from_another_thread():
    async def main():
        env = FaultyEnv(GridNavEnv(), Faults(hang_prob=1.0, hang_seconds=30.0))
        await env.areset(0)
        step = asyncio.ensure_future(env.astep("up"))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, env.close)
        with pytest.raises(InjectedFault, match="hang released by close"):
            await asyncio.wait_for(step, 2.0)

    asyncio.run(main())


def test_async_hang_ends_after_hang_seconds():
    async def main():
        env = FaultyEnv(GridNavEnv(), Faults(hang_prob=1.0, hang_seconds=0.05))
        await env.areset(0)
        with pytest.raises(InjectedFault, match="injected hang of 0.05s"):
            await env.astep("up")

    asyncio.run(main())


def test_sync_hang_released_by_close():
    env = FaultyEnv(GridNavEnv(), Faults(hang_prob=1.0, hang_seconds=30.0))
    env.reset(0)
    errors: list[BaseException] = []

    def worker():
        try:
            env.step("up")
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=worker)
    t0 = time.perf_counter()
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    env.close()
    t.join(2.0)
    assert not t.is_alive() and time.perf_counter() - t0 < 2.0
    assert len(errors) == 1 and isinstance(errors[0], InjectedFault)
    assert "hang released by close" in str(errors[0])
    assert env.injected_hangs == 1


# -- latency and start-up ---------------------------------------------------------------
def test_startup_delay_once_per_instance():
    f = Faults(startup=0.1)
    env = FaultyEnv(GridNavEnv(), f)
    t0 = time.perf_counter()
    env.reset(0)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    env.reset(1)
    second = time.perf_counter() - t0
    assert first >= 0.1 and second < 0.05
    assert env.latency_seconds == pytest.approx(0.1)

    async def fresh():  # a new instance pays again, on the async path too
        other = FaultyEnv(GridNavEnv(), f)
        t0 = time.perf_counter()
        await other.areset(0)
        return time.perf_counter() - t0

    assert asyncio.run(fresh()) >= 0.1


def test_step_latency_is_slept_and_counted():
    env = FaultyEnv(GridNavEnv(), Faults(step=0.02))
    env.reset(0)
    t0 = time.perf_counter()
    for _ in range(3):
        env.step("up")
    assert time.perf_counter() - t0 >= 0.06
    assert env.latency_seconds == pytest.approx(0.06)


# -- with_faults and full episodes ------------------------------------------------------
def _play_sync(env, seed: int, actions: list[str]) -> list:
    out = [env.reset(seed)]
    for a in actions:
        r = env.step(a)
        out.append((r.observation, r.reward, r.done, r.info))
        if r.done:
            break
    return out


async def _play_async(env, seed: int, actions: list[str]) -> list:
    out = [await env.areset(seed)]
    for a in actions:
        r = await env.astep(a)
        out.append((r.observation, r.reward, r.done, r.info))
        if r.done:
            break
    return out


def test_with_faults_keeps_name_pickles_and_plays_identically():
    actions = ["up", "left", "jump", "right", "down", "right", "up", "up"]
    for name in sorted(BUILTIN_TASKS):
        plain = get_task(name)
        task = with_faults(name, Faults(step=0.001))
        assert isinstance(task, Task) and task.name == plain.name
        assert task.max_turns == plain.max_turns and task.reward_fn is plain.reward_fn
        task2 = pickle.loads(pickle.dumps(task))
        factory = pickle.loads(pickle.dumps(task.env_factory))
        assert isinstance(factory, FaultyEnvFactory) and factory == task.env_factory
        for seed in range(3):
            want = _play_sync(plain.env_factory(), seed, actions)
            assert _play_sync(task2.env_factory(), seed, actions) == want
            assert _play_sync(factory(), seed, actions) == want
            assert asyncio.run(_play_async(task.env_factory(), seed, actions)) == want


def test_with_faults_accepts_a_task_and_checks_its_arguments():
    task = with_faults(get_task("gridnav"), none())
    assert isinstance(task.env_factory(), FaultyEnv)
    with pytest.raises(TypeError, match="needs a rollart.chaos.faults.Faults"):
        with_faults("gridnav", 0.1)
    with pytest.raises(KeyError, match="unknown task"):
        with_faults("nope", none())
    with pytest.raises(TypeError, match="pass the env class, not an instance"):
        FaultyEnvFactory(GridNavEnv(), none())


def test_inner_async_methods_are_preferred():
    class AsyncEnv(GridNavEnv):
        calls = 0

        async def areset(self, seed):
            AsyncEnv.calls += 1
            return self.reset(seed)

        async def astep(self, action):
            AsyncEnv.calls += 1
            return self.step(action)

    env = FaultyEnv(AsyncEnv(), none())
    want = _play_sync(GridNavEnv(), 5, ["up", "right"])
    assert asyncio.run(_play_async(env, 5, ["up", "right"])) == want
    assert AsyncEnv.calls == len(want)


def test_without_faults_undoes_with_faults():
    from rollart.chaos.faults import without_faults
    from rollart.env.tasks import BUILTIN_TASKS

    plain = BUILTIN_TASKS["gridnav"]
    faulty = with_faults(with_faults(plain, Faults(step=0.01)), Faults(fail_prob=1.0))
    assert without_faults(faulty) == plain
    assert without_faults("boxpush") is BUILTIN_TASKS["boxpush"]
