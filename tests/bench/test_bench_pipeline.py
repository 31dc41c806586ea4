"""benchmarks/pipeline.py runs tiny and prints its RESULT keys; the sandbox-like workload
(rollart.chaos.workload) burns CPU, fails resets at its rate and reuses pooled envs."""

import asyncio
import importlib
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart.chaos.faults import Latency
from rollart.chaos.workload import (SandboxError, Workload, drain_pools, pool_stats,
                                  with_workload)

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("speedup_vs_syncplus", "speedup_vs_sync", "speedup_vs_oneoff", "speedup_vs_areal",
            "throughput_vs_sync", "heldout_async", "heldout_syncplus", "seeds", "target")
NO_WAIT = Latency("fixed", 0.0)


def _free(**kw) -> Workload:
    """A workload with no waits and no CPU unless given (the knob under test only)."""
    base = dict(step_cpu=0.0, reset_cpu=0.0, create_cpu=0.0, step_wait=NO_WAIT,
                reuse_reset=NO_WAIT, create=NO_WAIT, fail_wait=NO_WAIT, reset_fail_prob=0.0)
    return Workload(**{**base, **kw})


def test_a_step_burns_cpu_in_proportion_to_its_work():
    task = with_workload("gridnav", _free(scale=1.0, step_cpu=0.05))  # 1000 blocks
    env = task.env_factory()
    env.reset(1)
    before, t0 = pool_stats()["cpu_blocks"], time.process_time()
    env.step("up")
    spent = time.process_time() - t0
    env.close()
    assert pool_stats()["cpu_blocks"] - before == 1000
    assert spent > 0.01  # 64 MiB hashed: real work on this thread, not a sleep


def test_async_step_runs_its_cpu_off_the_event_loop_and_waits_its_latency():
    task = with_workload("gridnav", _free(scale=1.0, step_cpu=0.02,
                                          step_wait=Latency("fixed", 0.05)))

    async def episode():
        env = task.env_factory()
        await env.areset(3)
        t0, c0 = time.perf_counter(), time.thread_time()
        await env.astep("up")
        wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - c0
        env.close()
        return wall, loop_cpu

    wall, loop_cpu = asyncio.run(episode())
    assert wall >= 0.05
    assert loop_cpu < 0.01  # the hashing ran on the sandbox threads, not the loop's


def test_resets_fail_at_the_configured_rate_and_are_retried():
    drain_pools()
    task = with_workload("guess", _free(reset_fail_prob=0.3, max_reset_attempts=50))
    for seed in range(3000):
        env = task.env_factory()
        assert isinstance(env.reset(seed), str)  # every reset ends with a sandbox up
        env.close()
    s = drain_pools()
    assert s["resets"] == 3000 + s["reset_failures"]  # each failure was retried
    rate = s["reset_failures"] / s["resets"]
    assert 0.27 < rate < 0.33, s  # 0.3 ± 4 standard errors of ~4300 draws
    assert s["discarded"] == s["reset_failures"]  # a failed sandbox is not reused


def test_a_reset_that_keeps_failing_raises_after_the_last_attempt():
    drain_pools()
    env = with_workload("guess", _free(reset_fail_prob=0.999, max_reset_attempts=3)) \
        .env_factory()
    with pytest.raises(SandboxError, match="3 times"):
        env.reset(7)
    assert drain_pools()["resets"] == 3


def test_closed_envs_go_back_to_the_pool_and_a_reused_one_resets_faster():
    drain_pools()
    w = _free(scale=1.0, create=Latency("fixed", 0.2), reuse_reset=Latency("fixed", 0.01))
    task = with_workload("gridnav", w)
    first = task.env_factory()
    t0 = time.perf_counter()
    first.reset(1)
    cold = time.perf_counter() - t0
    inner = first.box.env
    first.close()
    assert pool_stats()["idle"] == 1
    again = pickle.loads(pickle.dumps(task)).env_factory()  # as a worker unpickles it
    t0 = time.perf_counter()
    again.reset(2)
    warm = time.perf_counter() - t0
    assert again.box.env is inner  # the same sandbox, taken from the pool
    assert cold >= 0.2 > warm
    again.close()
    s = drain_pools()
    assert (s["created"], s["reused"], s["idle"]) == (1, 1, 1)
    assert pool_stats()["idle"] == 0


def test_clock_takes_earlier_checkpoints_out_of_the_run_time(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("pipeline")
    rows = [{"step": 1, "time": 2.0}, {"step": 2, "time": 5.0}, {"step": 3, "time": 9.0}]
    assert bench.clock(rows, {1: 0.5, 2: 1.0}) == {1: 2.0, 2: 4.5, 3: 7.5}


def test_a_mode_that_never_reaches_the_target_counts_inf(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("pipeline")
    runs = [{"label": m, "seed": s, "time_to_target_s": t, "traj_per_s": tps, "heldout": 0.5}
            for m, s, t, tps in [("async", 1, 10.0, 30.0), ("async", 2, 20.0, 40.0),
                                 ("sync", 1, 40.0, 10.0), ("sync", 2, math.inf, 10.0),
                                 ("sync+", 1, 30.0, 20.0), ("sync+", 2, 30.0, 20.0)]]
    out = bench.summarise(runs, [1, 2])
    assert out["speedup_vs_sync"] == math.inf  # median of (40, inf) over async's 15
    assert (out["speedup_vs_sync_min"], out["speedup_vs_sync_max"]) == (4.0, math.inf)
    assert out["speedup_vs_syncplus"] == 2.0
    assert out["throughput_vs_sync"] == 3.5 and math.isnan(out["speedup_vs_areal"])
    assert list(out)[:len(REQUIRED)] == list(REQUIRED)


@pytest.mark.bench
def test_pipeline_benchmark_tiny():
    """Two modes, one seed, one step; the target below the warm-up's success, so both
    reach it at their first checkpoint and every ratio is finite."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--steps", "1",
         "--every", "1", "--groups", "2", "--eval-seeds", "4", "--seeds", "1",
         "--modes", "sync,async", "--redundant", "", "--warmup-steps", "5",
         "--margin", "-1", "--warm-cache", "", "--weight-update", "keep"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    r = dict(kv.split("=") for kv in line.split()[1:])
    assert r.pop("inflight") == "alpha" and r.pop("order") == "completion", line
    assert r.pop("weight_update") == "keep", line
    r = {k: float(v) for k, v in r.items()}
    assert list(r)[:len(REQUIRED)] == list(REQUIRED), line
    for k in ("speedup_vs_sync", "throughput_vs_sync", "ttt_async", "ttt_sync",
              "tps_async", "tps_sync"):
        assert 0 < r[k] < math.inf, (k, line)
    assert 0 <= r["heldout_async"] <= 1 and r["seeds"] == 1
    assert math.isnan(r["speedup_vs_syncplus"])  # sync+ did not run
    assert "seed 1: order" in out.stdout
