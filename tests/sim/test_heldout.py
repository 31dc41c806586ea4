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
from rollart.sim.heldout import (FIT, FIT_SEED, HELDOUT, Setting, errors, invocation_seeds,
                                 setting_graph, summarise)
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
    assert fit.policy.weight_update == "recompute" and fit.rollout.inference_pools == (H800,)
    for s in HELDOUT:
        g = setting_graph(base, s, "m", 10, 12, 1)
        diff = {k for k in FIELDS if _field(g, k) != _field(fit, k)}
        if s.mode != FIT.mode:  # a mode brings its own default alpha
            assert diff - {"alpha"} == {"mode"}, (s, diff)
        else:
            assert diff == {WHAT[s.name]}, (s, diff)
    assert setting_graph(base, Setting("x", env_slots=0.5), "m", 10, 12, 1) \
        .rollout.env_concurrency == 48
    with pytest.raises(ValueError, match="nope"):
        setting_graph(base, Setting("x", tasks=("nope",)), "m", 10, 12, 1)


WHAT = {"alpha2": "alpha", "env_x2": "scale", "slots_half_step": "slots",
        "gridnav_boxpush": "tasks", "workers_x2": "pools", "pd": "affinity",
        "weights_keep": "weight_update"}
FIELDS = ("mode", "alpha", "scale", "slots", "tasks", "pools", "affinity", "weight_update")


def _field(g, k):
    return {"mode": g.mode, "alpha": g.algo.alpha, "slots": g.rollout.env_concurrency,
            "scale": g.tasks[0].env_factory.workload.scale,
            "tasks": tuple(t.name for t in g.tasks), "pools": g.rollout.inference_pools,
            "affinity": {t.affinity for t in g.tasks},
            "weight_update": g.policy.weight_update}[k]


def _planted_fit(tasks) -> dict:
    """``heldout.fit``'s answer with planted costs (no probe run)."""
    from rollart.sim.costs import ControlPlane, GPUSpec, GenCost, TrainCost, WeightSync
    from rollart.sim.measure import EngineFit

    cpu = GPUSpec("cpu", 1e10, 1e10, 1e9)
    one = EngineFit(cpu, GenCost(MODELS["tiny"], cpu, step_overhead_s=1e-3),
                    TrainCost(MODELS["tiny"], cpu, gpus=1, mfu=1.0, overhead_s=0.05),
                    WeightSync("tcp"), 1e-4, {}, {}, {}, 0.0)
    shapes = {t: TaskShape(turns=3, prompt_tokens=40, obs_tokens=10, response_tokens=4)
              for t in tasks}
    return {"fits": {"overlapping": one, "lockstep": one},
            "control": ControlPlane(actor_call_s=1e-3, task_s=5e-3), "shapes": shapes,
            "turn_s": 1e-4}


def test_the_gpu_side_settings_are_simulated_from_the_fit_alone():
    """Two workers: one simulated CPU engine per tag; PD: each turn prefilled on the H800
    worker and decoded on the H20 one (the pools the runtime would place, from the
    tasks' affinities); weights_keep: workers that load without re-prefilling."""
    from rollart.sim.cluster import Cluster
    from rollart.sim.heldout import setting_sim

    base = replace(Graph(name="h", tasks=("gridnav", "guess", "boxpush")),
                   rollout=Rollout(inference_pools=(H800,)))
    fitted = _planted_fit(("gridnav", "guess", "boxpush"))
    by_name = {s.name: s for s in (FIT, *HELDOUT)}
    cfgs = {n: setting_sim(setting_graph(base, by_name[n], "m", 2, 2, 1), fitted, 2)
            for n in ("fit", "workers_x2", "pd", "weights_keep")}
    pools = {n: [(p.tag, p.gpu, p.count) for p in c.cluster.inference]
             for n, c in cfgs.items()}
    assert pools["fit"] == pools["weights_keep"] == [(H800, "cpu", 1)]
    assert pools["workers_x2"] == pools["pd"] == [(H800, "cpu", 1), ("H20", "cpu", 1)]
    assert [w.keep_kv for w in Cluster(cfgs["weights_keep"]).workers] == [True]
    assert [w.keep_kv for w in Cluster(cfgs["fit"]).workers] == [False]
    runs = {n: simulate(replace(c, record=True)) for n, c in cfgs.items()}
    assert {(tag, phase) for _, tag, phase in runs["pd"].decisions} == \
        {(H800, "prefill"), ("H20", "decode")}
    assert {tag for _, tag, _ in runs["workers_x2"].decisions} == {H800, "H20"}
    assert {phase for _, _, phase in runs["workers_x2"].decisions} == {"gen"}
    for n, r in runs.items():
        assert r.trained >= 2 * 2 * base.algo.group_size and \
            r.throughput["trajectories_s"] > 0, n


def test_each_invocation_has_its_own_seeds():
    got = [invocation_seeds(i, (1, 2, 3)) for i in range(4)]
    assert got[0] == ((1, 2, 3), FIT_SEED)
    assert got[2] == ((201, 202, 203), FIT_SEED + 200)
    used = [s for seeds, fit in got for s in (*seeds, fit, fit + 1)]  # fit + 1: lone turn
    assert len(used) == len(set(used))
    with pytest.raises(ValueError, match="seeds must be in"):
        invocation_seeds(1, (1, 150))


def test_summary_counts_each_invocation_and_keeps_the_worst():
    names = ["a", "b", "c", "d"]
    runs = [{"fit": 0.02, "a": 0.10, "b": 0.15, "c": 0.30, "d": 0.01},  # 3 within (0.15 is)
            {"fit": 0.05, "a": 0.16, "b": 0.20, "c": 0.05, "d": 0.40},  # 1 within
            {"fit": 0.01, "a": 0.00, "b": 0.01, "c": 0.02, "d": 0.03}]  # 4 within
    out = summarise(runs, names)
    assert list(out)[:4] == ["heldout_within_015", "heldout_worst", "invocations",
                             "heldout_configs"]
    assert (out["heldout_within_015"], out["heldout_worst"], out["invocations"],
            out["heldout_configs"]) == (1, 0.40, 3, 4)
    assert [out[f"heldout_within_015_{i}"] for i in (1, 2, 3)] == [3, 1, 4]
    assert [out[f"heldout_worst_{i}"] for i in (1, 2, 3)] == [0.30, 0.40, 0.03]
    assert [out[f"heldout_missed_{i}"] for i in (1, 2, 3)] == ["c", "a,b,d", "none"]
    # the old figure: the median of every held-out error (the fit's left out)
    assert out["calibration_error_heldout"] == pytest.approx(0.075)
    assert out["calibration_error_fit"] == 0.05
    one = summarise(runs[:1], names)  # one invocation: the old median of its errors
    assert one["calibration_error_heldout"] == pytest.approx(0.125)
    assert one["heldout_within_015"] == one["heldout_within_015_1"] == 3


def test_summary_counts_a_missing_comparison_as_a_miss_and_names_gaps():
    out = summarise([{"a": math.nan, "b": 0.5}, {"a": 0.1, "b": 0.1}], ["a", "b"])
    assert out["heldout_within_015_1"] == 0 and out["heldout_missed_1"] == "a,b"
    assert math.isnan(out["heldout_worst_1"]) and math.isnan(out["heldout_worst"])
    assert out["heldout_within_015"] == 0 and out["heldout_within_015_2"] == 2
    with pytest.raises(ValueError, match=r"no error for \['b'\]"):
        summarise([{"a": 0.1}], ["a", "b"])
    with pytest.raises(ValueError, match="at least one invocation"):
        summarise([], ["a"])


def test_errors_compare_the_medians_over_seeds():
    real = {"a": {1: 10.0, 2: 12.0, 3: 30.0}, "b": {1: 4.0}}
    sim = {"a": {1: 9.0, 2: 15.0, 3: 11.0}, "b": {1: 5.0}}
    assert errors(real, sim) == pytest.approx({"a": 1 / 12, "b": 0.25})


@pytest.mark.bench
def test_cluster_sim_heldout_tiny():
    """benchmarks/cluster_sim.py --heldout --tiny: a short warm-up, the fit's probes,
    real runs of the fit and two held-out settings (one of them PD), their predictions:
    the RESULT line, one invocation."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_sim.py"),
                          "--heldout", "--tiny"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = dict(kv.split("=") for kv in line.split()[1:])
    assert (got["invocations"], got["heldout_configs"], got["frozen"]) == ("1", "2", "none")
    within, worst = int(got["heldout_within_015"]), float(got["heldout_worst"])
    assert within == int(got["heldout_within_015_1"]) and 0 <= within <= 2, line
    assert 0 <= worst == float(got["heldout_worst_1"]) < 10, line
    missed = got["heldout_missed_1"]
    assert (missed == "none") == (within == 2) and (worst <= 0.15) == (within == 2), line
    assert set(missed.split(",")) <= {"none", "env_x2", "pd"}, line
    assert 0 <= float(got["calibration_error_heldout"]) <= worst, line
    assert "invocation 1: fit=" in out.stdout and " pd=" in out.stdout
