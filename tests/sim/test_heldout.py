"""The held-out calibration's parts (rollart.sim.heldout, rollart.sim.sandbox): the
simulator's sandbox pool follows rollart.chaos.workload's own pool, the simulator gives a
trajectory's sandbox back, and each held-out setting changes one thing of the fit's."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rollart import GRPO, Graph, Policy, Rollout
from rollart.chaos.faults import Latency
from rollart.env.tasks import get_task
from rollart.chaos.workload import (SandboxError, Workload, drain_pools, pool_stats,
                                  with_workload)
from rollart.sim import ClusterSpec, EnvPool, GPUPool, RewardPool, SimConfig, TaskShape, simulate
from rollart.sim.costs import MODELS, Costs
from rollart.sim.heldout import FIT, HELDOUT, Setting, errors, setting_graph
from rollart.sim.sandbox import SandboxPoolCost
from rollart.types import H800

ROOT = Path(__file__).resolve().parents[2]
TINY = 1e-6  # a workload scale at which the real pool's waits take no time


def _real_pool_counts(work: Workload, live: int, episodes: int) -> dict:
    """The real pool (rollart.chaos.workload) with ``live`` envs open at once: open
    ``live``, then close the oldest and open another until ``episodes`` have reset."""
    drain_pools()
    before = pool_stats()
    factory = with_workload(get_task("gridnav"), work).env_factory
    open_, seed = [], 0
    for _ in range(episodes):
        if len(open_) == live:
            open_.pop(0).close()
        env = factory()
        seed += 1
        try:
            env.reset(seed)
        except SandboxError:  # every attempt failed (0.24%): no sandbox held
            continue
        open_.append(env)
    for env in open_:
        env.close()
    after = pool_stats()
    drain_pools()
    return {k: after[k] - before[k] for k in ("created", "reused", "reset_failures")}


def _sim_pool_counts(work: Workload, live: int, episodes: int) -> dict:
    """The same pattern through ``SandboxPoolCost`` (reset = ``sample_reset``, close of a
    reset env = ``release``)."""
    pool, rng, held = SandboxPoolCost(work), random.Random(0), 0
    for _ in range(episodes):
        if held == live:
            pool.release()
            held -= 1
        pool.sample_reset(rng)
        held += 1
    return {k: pool.counts[k] for k in ("created", "reused", "reset_failures")}


@pytest.mark.parametrize("live", [1, 6])
def test_the_simulated_pool_creates_reuses_and_fails_as_the_real_one(live):
    work = Workload(scale=TINY, seed=3)
    n = 1500
    real, sim = _real_pool_counts(work, live, n), _sim_pool_counts(work, live, n)
    for counts in (real, sim):
        attempts = counts["created"] + counts["reused"]
        counts["fail_rate"] = counts["reset_failures"] / attempts
        counts["create_rate"] = counts["created"] / attempts
    # the same rules give the same rates (different draws): a failure discards its
    # sandbox, so each one is followed by a creation unless another is idle
    assert abs(real["fail_rate"] - sim["fail_rate"]) < 0.04, (real, sim)
    assert abs(real["create_rate"] - sim["create_rate"]) < 0.04, (real, sim)
    assert sim["reused"] > sim["created"] > 0, sim


def _lognormal_mean(lat: Latency) -> float:
    return lat.seconds * math.exp(lat.sigma ** 2 / 2)


def test_the_simulated_reset_and_step_take_the_workloads_declared_seconds():
    """Mean seconds over many draws against the workload's distributions: a warm reset
    pays reuse_reset, a failed attempt fail_wait and another attempt; a step its CPU and
    its wait, every duration at Workload.scale."""
    w = Workload(scale=0.01, reset_fail_prob=0.0)
    pool, rng = SandboxPoolCost(w), random.Random(1)
    pool.idle = 10 ** 6  # every reset finds a warm sandbox
    n = 20000
    reset = sum(pool.sample_reset(rng) for _ in range(n)) / n
    want = w.scale * (w.reset_cpu + _lognormal_mean(w.reuse_reset))
    assert reset == pytest.approx(want, rel=0.03)
    step = sum(pool.sample_step(rng)[0] for _ in range(n)) / n
    assert step == pytest.approx(w.scale * (w.step_cpu + _lognormal_mean(w.step_wait)),
                                 rel=0.06)
    failing = SandboxPoolCost(replace(w, reset_fail_prob=0.5), idle=10 ** 6)
    mean = sum(failing.sample_reset(rng) for _ in range(n)) / n
    # attempts until success (at most 5): each failed one pays reset_cpu + fail_wait
    fails = sum(0.5 ** k for k in range(1, 5))  # expected failed attempts
    want_f = w.scale * (w.reset_cpu * (1 + fails) + _lognormal_mean(w.reuse_reset)
                        * (1 - 0.5 ** 5) + _lognormal_mean(w.fail_wait) * (fails + 0.5 ** 5))
    assert mean == pytest.approx(want_f, rel=0.06)


def test_the_simulator_gives_each_trajectorys_sandbox_back():
    """A simulated run over a SandboxPoolCost reuses sandboxes (rollart.sim.cluster calls
    ``release`` when a trajectory that reset ends) and keeps no more than its env slots."""
    slots = 8
    g = Graph(name="sb", tasks=("gridnav",), mode="async", steps=3,
              policy=Policy(warmup_steps=0), algo=GRPO(group_size=4, groups_per_step=4),
              rollout=Rollout(inference_pools=(H800,)))
    pool = SandboxPoolCost(Workload(scale=0.01, reset_fail_prob=0.0))
    cfg = SimConfig(ClusterSpec((GPUPool(H800, "H800", 1),), (EnvPool("CPU_ENV", slots),),
                                RewardPool(), trainer_gpus=8),
                    g, Costs(model=MODELS["Qwen3-8B"], env={"*": pool}),
                    shapes={"gridnav": TaskShape(turns=3, prompt_tokens=50, obs_tokens=10,
                                                 response_tokens=8)}, steps=3)
    r = simulate(cfg)
    assert r.trained >= 3 * 16
    assert pool.counts["created"] <= slots < pool.counts["reused"], pool.counts
    assert pool.idle <= pool.counts["created"]  # (async's next groups hold some at the end)


def test_each_heldout_setting_changes_one_thing_of_the_fits_graph():
    base = replace(Graph(name="h", tasks=("gridnav", "guess", "boxpush")),
                   rollout=Rollout(inference_pools=(H800,)))
    fit = setting_graph(base, FIT, "m", 10, 12, 1)
    assert fit.mode == "async" and fit.rollout.redundancy == 1.0
    assert fit.algo.batch_size == 12 * base.algo.group_size
    assert {t.env_factory.workload.scale for t in fit.tasks} == {Workload().scale}
    assert {t.env_factory.workload.seed for t in fit.tasks} == {1}
    for s in HELDOUT:
        g = setting_graph(base, s, "m", 10, 12, 1)
        diff = {k for k in ("mode", "alpha", "scale", "slots", "tasks")
                if _field(g, k) != _field(fit, k)}
        if s.mode != FIT.mode:  # a mode brings its own default alpha
            assert diff - {"alpha"} == {"mode"}, (s, diff)
        else:
            assert diff == {WHAT[s.name]}, (s, diff)
    assert setting_graph(base, Setting("x", env_slots=0.5), "m", 10, 12, 1) \
        .rollout.env_concurrency == 48
    with pytest.raises(ValueError, match="nope"):
        setting_graph(base, Setting("x", tasks=("nope",)), "m", 10, 12, 1)


WHAT = {"alpha2": "alpha", "env_x2": "scale", "slots_half_step": "slots",
        "gridnav_boxpush": "tasks"}


def _field(g, k):
    return {"mode": g.mode, "alpha": g.algo.alpha, "slots": g.rollout.env_concurrency,
            "scale": g.tasks[0].env_factory.workload.scale,
            "tasks": tuple(t.name for t in g.tasks)}[k]


def test_errors_compare_the_medians_over_seeds():
    real = {"a": {1: 10.0, 2: 12.0, 3: 30.0}, "b": {1: 4.0}}
    sim = {"a": {1: 9.0, 2: 15.0, 3: 11.0}, "b": {1: 5.0}}
    assert errors(real, sim) == pytest.approx({"a": 1 / 12, "b": 0.25})


@pytest.mark.bench
def test_cluster_sim_heldout_tiny():
    """benchmarks/cluster_sim.py --heldout --tiny: a short warm-up, the fit's probes,
    real runs of the fit and two held-out settings, their predictions: the RESULT line."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_sim.py"),
                          "--heldout", "--tiny"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    for key in ("err_fit", "err_env_x2", "err_sync"):
        assert 0 <= got[key] < 10, line
    assert got["calibration_error_heldout"] == pytest.approx(
        (got["err_env_x2"] + got["err_sync"]) / 2, rel=1e-3)
    assert got["calibration_error_fit"] == got["err_fit"]
