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
HEADLINE = tuple(k for b in ("syncplus", "areal", "areal_at_async", "sync", "oneoff")
                 for k in (f"speedup_vs_{b}_paired", f"wins_vs_{b}", f"pairs_vs_{b}"))
INFLIGHT = ("inflight_async", "inflight_areal", "inflight_areal_at_async")
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


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("pipeline")


def test_the_clock_is_the_rows_time_for_every_mode(monkeypatch):
    bench = _bench(monkeypatch)
    rows = [{"step": 1, "time": 2.0}, {"step": 2, "time": 5.0}, {"step": 3, "time": 9.0}]
    assert bench.clock(rows) == {1: 2.0, 2: 5.0, 3: 9.0}  # checkpoint writes on it too


def test_in_flight_is_the_time_mean_of_the_groups_held_in_steps_worth(monkeypatch):
    bench = _bench(monkeypatch)
    row = {"rollout/slots_held_s": 120.0, "rollout/slots_open_s": 10.0}
    assert bench.in_flight(row, groups=6) == 2.0
    assert math.isnan(bench.in_flight({"rollout/slots_open_s": 0}, groups=6))  # lockstep


def test_kept_rows_have_the_whole_curve_and_the_first_crossing_is_the_time(
        monkeypatch, tmp_path):
    """``--keep-rows``: every checkpoint is evaluated, not only until the target; the
    time to target is still the first crossing's clock; the file holds the rows."""
    import json

    import rollart.observe.evaluate as ev

    bench = _bench(monkeypatch)
    success = {"s3": 0.2, "s6": 0.5, "s9": 0.3, "s12": 0.6}
    monkeypatch.setattr(ev, "evaluate", lambda path, tasks, seeds: {"t": success[path]})
    rows = [{"step": s, "time": 2.0 * s} for s in range(1, 13)]

    def run():
        return {"label": "async@keep", "seed": 2, "clock": bench.clock(rows),
                "snapshots": [(s, f"s{s}") for s in (3, 6, 9, 12)],
                "run_dir": str(tmp_path / "gone"), "rows": rows}

    part = bench.score(run(), ("t",), range(4), target=0.4)
    assert part["curve"] == {3: 0.2, 6: 0.5, 12: 0.6} and part["time_to_target_s"] == 12.0
    # the record's step figures, from a run scored only until its target and its last
    figs = bench.run_figures(part, 0.4)
    assert (figs["steps_to_target"], figs["time_to_target_s"], figs["final"]) == (6, 12.0, 0.6)
    assert figs["s_step"] == 2.0
    whole = bench.score(run(), ("t",), range(4), target=0.4, whole=True)
    assert whole["curve"] == {3: 0.2, 6: 0.5, 9: 0.3, 12: 0.6}
    assert whole["time_to_target_s"] == 12.0 and whole["heldout"] == 0.6
    bench.keep_rows(str(tmp_path / "kept"), whole)
    kept = json.loads((tmp_path / "kept" / "async_at_keep-seed2.json").read_text())
    assert kept["rows"] == rows and kept["curve"] == {"3": 0.2, "6": 0.5, "9": 0.3, "12": 0.6}
    assert "rows" not in whole  # not carried into the records
    never = bench.score(run(), ("t",), range(4), target=0.9, whole=True)
    assert math.isinf(never["time_to_target_s"]) and len(never["curve"]) == 4


def test_paired_ratios_wins_and_spread_on_planted_times(monkeypatch):
    bench = _bench(monkeypatch)
    inf = math.inf
    ours = {1: 10.0, 2: 20.0, 3: 30.0, 4: inf, 5: inf, 6: 8.0}
    theirs = {1: 15.0, 2: 10.0, 3: inf, 4: 12.0, 5: inf, 7: 1.0}  # seed 6/7: no pair
    p = bench.paired(theirs, ours)
    # 1.5 (win), 0.5 (loss), inf (only async got there: a win), 0 (only the baseline:
    # a loss), 1 (neither: a tie, not a win, still counted)
    assert p["ratios"] == [1.5, 0.5, inf, 0.0, 1.0]
    assert (p["wins"], p["pairs"], p["median"], p["min"], p["max"]) == (2, 5, 1.0, 0.0, inf)
    assert bench.paired({1: 10.0}, {1: 10.0})["wins"] == 0  # a tie is not a win
    empty = bench.paired({}, {1: 3.0})
    assert empty["pairs"] == 0 and math.isnan(empty["median"]) and math.isnan(empty["min"])


def test_the_headline_is_paired_and_a_mode_that_never_reaches_the_target_counts_inf(
        monkeypatch):
    bench = _bench(monkeypatch)
    runs = [{"label": m, "seed": s, "time_to_target_s": t, "traj_per_s": tps,
             "heldout": 0.5, "inflight": f}
            for m, s, t, tps, f in [
                ("async", 1, 10.0, 30.0, 1.0), ("async", 2, 20.0, 40.0, 0.9),
                ("async", 3, 30.0, 40.0, 0.8),
                ("sync", 1, 40.0, 10.0, math.nan), ("sync", 2, math.inf, 10.0, math.nan),
                ("sync+", 1, 30.0, 20.0, math.nan), ("sync+", 2, 10.0, 20.0, math.nan),
                ("sync+", 3, 60.0, 20.0, math.nan),
                ("areal", 1, 5.0, 50.0, 2.0), ("areal", 2, 10.0, 50.0, 1.8),
                ("areal", 3, math.inf, 50.0, 1.6),
                ("areal@async", 1, 20.0, 40.0, 1.0), ("areal@async", 3, 60.0, 40.0, 1.0)]]
    out = bench.summarise(runs, [1, 2, 3])
    assert list(out)[:len(HEADLINE)] == list(HEADLINE)
    # sync+ ÷ async per seed: 3, 0.5, 2 -> median 2 (the ratio of medians is 1.5)
    assert (out["speedup_vs_syncplus_paired"], out["wins_vs_syncplus"],
            out["pairs_vs_syncplus"]) == (2.0, 2, 3)
    assert out["speedup_vs_syncplus"] == 1.5
    assert (out["speedup_vs_syncplus_min"], out["speedup_vs_syncplus_max"]) == (0.5, 3.0)
    # areal: 0.5, 0.5, inf (areal never got there on seed 3: async's win) -> 1 win of 3
    assert (out["speedup_vs_areal_paired"], out["wins_vs_areal"]) == (0.5, 1)
    assert out["speedup_vs_areal_max"] == math.inf
    # at async's budget: seeds 1 and 3 only (seed 2's run failed): 2 and 2
    assert (out["speedup_vs_areal_at_async_paired"], out["wins_vs_areal_at_async"],
            out["pairs_vs_areal_at_async"]) == (2.0, 2, 2)
    assert out["speedup_vs_sync"] == math.inf  # median of (40, inf) over async's 20
    assert (out["speedup_vs_sync_min"], out["speedup_vs_sync_max"]) == (4.0, math.inf)
    assert (out["inflight_async"], out["inflight_areal"], out["inflight_areal_at_async"]) \
        == (0.9, 1.8, 1.0)
    assert out["throughput_vs_sync"] == 4.0 and math.isnan(out["speedup_vs_oneoff"])
    assert out["pairs_vs_oneoff"] == 0 and out["wins_vs_oneoff"] == 0
    rest = [k for k in out if k not in HEADLINE and k not in INFLIGHT]
    assert rest[:len(REQUIRED)] == list(REQUIRED)


def test_areal_at_async_gets_asyncs_budget_and_the_rest_their_own(monkeypatch):
    bench = _bench(monkeypatch)
    import rollart

    base, _ = rollart.load_graph("multitask")
    a = bench.parse(["--quick", "--no-record"])
    assert a.modes == bench.MODES and bench.parse([]).modes == bench.MODES + (bench.AT_ASYNC,)
    graphs = {label: bench.label_graph(base, base.tasks, "m", label, 1, a)
              for label in ("areal", "areal@async", "async", "async@r")}
    assert graphs["areal@async"].mode == "areal"
    # async's default adapts its limit, so areal@async adapts by the same rule
    assert graphs["areal@async"].rollout.max_in_flight == \
        bench.async_budget(graphs["async"]) == "auto"
    assert graphs["areal"].rollout.max_in_flight is None  # its own start bound
    one = bench.label_graph(base, base.tasks, "m", "async@one", 1, a)
    assert (one.max_in_flight, one.stale_members) == (1.0, "abort")  # the earlier default
    assert bench.async_budget(one) == 1
    assert graphs["async@r"].rollout.redundancy == a.redundancy
    assert graphs["areal@async"].rollout.redundancy == 1.0
    wide = bench.parse(["--quick", "--max-in-flight", "2"])
    assert bench.label_graph(base, base.tasks, "m", "areal@async", 1, wide) \
        .rollout.max_in_flight == 2
    assert {g.algo.lr for g in graphs.values()} == {base.algo.lr}  # the graph's
    slow = bench.parse(["--quick", "--lr", "2.5e-4"])  # every mode alike
    assert {bench.label_graph(base, base.tasks, "m", label, 1, slow).algo.lr
            for label in ("areal", "async", "async@keep", "sync+")} == {2.5e-4}


@pytest.mark.bench
def test_pipeline_benchmark_tiny():
    """Four runs (sync, areal at its own budget and at async's, async), one seed, two
    steps; the target below the warm-up's success, so every run reaches it at its first
    checkpoint and every ratio is finite."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--steps", "2",
         "--every", "1", "--groups", "2", "--eval-seeds", "4", "--seeds", "1",
         "--modes", "sync,areal,areal@async,async", "--redundant", "", "--warmup-steps", "5",
         "--margin", "-1", "--warm-cache", "", "--weight-update", "keep"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    r = dict(kv.split("=") for kv in line.split()[1:])
    # every mode at its own in-flight setting; areal@async adapts as async's default does
    assert r.pop("inflight") == "mode" and r.pop("order") == "mode", line
    assert r.pop("budget_areal_at_async") == "auto", line
    assert r.pop("weight_update") == "keep", line
    assert (r.pop("ours"), r.pop("resources")) == ("async", "laptop"), line
    r = {k: float(v) for k, v in r.items()}
    assert list(r)[:len(HEADLINE)] == list(HEADLINE), line
    rest = [k for k in r if k not in HEADLINE and k not in INFLIGHT]
    assert rest[:len(REQUIRED)] == list(REQUIRED), line
    for k in ("speedup_vs_sync", "throughput_vs_sync", "ttt_async", "ttt_sync",
              "tps_async", "tps_sync", "speedup_vs_areal_paired",
              "speedup_vs_areal_at_async_paired", "ttt_areal_at_async", *INFLIGHT):
        assert 0 < r[k] < math.inf, (k, line)
    for key in ("sync", "areal", "areal_at_async"):
        assert r[f"pairs_vs_{key}"] == 1 and r[f"wins_vs_{key}"] in (0, 1), line
        assert r[f"speedup_vs_{key}_min"] == r[f"speedup_vs_{key}_max"] \
            == r[f"speedup_vs_{key}_paired"], line  # one seed: one ratio
        # a win is a ratio above 1; the RESULT line prints 4 digits, so a win by less
        # than that reads as 1 (seen once: a tiny run's 1.0000x against areal)
        ratio = r[f"speedup_vs_{key}_paired"]
        assert ratio == 1 or r[f"wins_vs_{key}"] == (ratio > 1), line
    # the budgets: async and areal@async adapt between one step's worth (2 groups) and
    # alpha + 1 steps' worth, areal holds at most its start bound's two steps' worth
    assert r["inflight_async"] <= 2 and r["inflight_areal_at_async"] <= 2, line
    assert r["inflight_areal"] <= 2, line
    assert r["pairs_vs_syncplus"] == 0 and math.isnan(r["speedup_vs_syncplus_paired"])
    assert 0 <= r["heldout_async"] <= 1 and r["seeds"] == 1
    assert math.isnan(r["speedup_vs_syncplus"])  # sync+ did not run
    assert "seed 1: order" in out.stdout


def test_an_async_variant_can_be_the_headline_paired_with_the_default_too(monkeypatch):
    """``--ours async@rescore``: the variant's times are the denominators, and the
    default async is one more baseline (``speedup_vs_async_paired``)."""
    bench = _bench(monkeypatch)
    import rollart

    runs = [{"label": m, "seed": s, "time_to_target_s": t, "traj_per_s": 1.0,
             "heldout": 0.5, "inflight": 1.0}
            for m, s, t in [("async", 1, 30.0), ("async", 2, 20.0),
                            ("async@rescore", 1, 10.0), ("async@rescore", 2, 40.0),
                            ("sync+", 1, 20.0), ("sync+", 2, 80.0)]]
    out = bench.summarise(runs, [1, 2], ours="async@rescore")
    assert (out["speedup_vs_async_paired"], out["wins_vs_async"]) == (1.75, 1)  # 3, 0.5
    assert (out["speedup_vs_syncplus_paired"], out["wins_vs_syncplus"]) == (2.0, 2)
    default = bench.summarise(runs, [1, 2])  # the default as the headline: the variant
    assert "speedup_vs_async_paired" not in default  # is one more baseline (1/3, 2)
    assert (default["speedup_vs_async_at_rescore_paired"],
            default["wins_vs_async_at_rescore"]) == (pytest.approx(7 / 6), 1)
    a = bench.parse(["--quick", "--no-record", "--modes", "async,async@rescore,sync+",
                     "--ours", "async@rescore"])
    base, _ = rollart.load_graph("multitask")
    g = bench.label_graph(base, base.tasks, "m", "async@rescore", 1, a)
    assert (g.mode, g.rollout.stale_members) == ("async", "rescore")
    from rollart.policy.admission import take_window_for

    # the default takes in start order; async@completion as the groups complete
    assert take_window_for(bench.label_graph(base, base.tasks, "m", "async", 1, a)) == \
        a.groups
    g = bench.label_graph(base, base.tasks, "m", "async@completion", 1, a)
    assert take_window_for(g) is None and g.max_in_flight == "auto"
    # the variants that keep stale groups set the GRPO field, the rest of the default kept
    g = bench.label_graph(base, base.tasks, "m", "async@completion_keep", 1, a)
    assert (take_window_for(g), g.algo.stale_groups, g.max_in_flight) == (None, "rescore",
                                                                          "auto")
    g = bench.label_graph(base, base.tasks, "m", "async@keep", 1, a)
    assert (take_window_for(g), g.algo.stale_groups) == (a.groups, "rescore")
    assert g.algo.group_size == base.algo.group_size
    with pytest.raises(SystemExit):  # a headline that does not run beside the default
        bench.parse(["--quick", "--modes", "async@rescore,sync+", "--ours", "async@rescore"])


def test_the_real_pipeline_builds_pipelines_labels_on_the_real_graph(monkeypatch, tmp_path):
    """``benchmarks/pipeline_real.py``: the labels are ``pipeline.label_graph``'s over
    ``graphs/real.py:lora`` (found from any folder), at the graph's own groups, LoRA and
    weight update, scored with its chat template; a label it cannot run is refused."""
    bench = _bench(monkeypatch)
    real = importlib.import_module("pipeline_real")
    monkeypatch.chdir(tmp_path)
    a = real.parse(["--modes", "sync+,areal,async,async@completion_clip"])
    base, opts = real.graph_and_tasks(a.graph, a)
    assert [t.name for t in base.tasks] == ["guess_number", "calculator"]
    assert opts["conversation"] == "chat" and opts["max_context"] == base.policy.max_context
    for label, mode in (("sync+", "sync+"), ("areal", "areal"), ("async", "async"),
                        ("async@completion_clip", "async")):
        g = bench.label_graph(base, base.tasks, "/m", label, 3, a)
        assert (g.mode, g.seed, g.steps, g.checkpoint_every) == (mode, 3, 20, 4)
        assert g.policy.model == "/m" and g.policy.lora == base.policy.lora is not None
        assert (g.algo.groups_per_step, g.algo.lr) == (base.algo.groups_per_step,
                                                        base.algo.lr)
    assert g.algo.stale_groups == "clip"
    for bad in (["--modes", "async,async@r"], ["--modes", "sync+", "--ours", "async@one"]):
        with pytest.raises(SystemExit):
            real.parse(bad)


def test_the_default_beside_the_earlier_one_on_the_engine_apart_layout_tiny():
    """Async's default (adaptive in flight, stale members re-scored) as the headline
    beside ``async@one`` (the earlier default: one step's worth, stale members aborted),
    on ``resources/laptop_engine.py`` (the engine in a worker process of its own): both
    train, they are paired, and the default's mean in flight stays within its bounds
    (one to ``alpha + 1`` steps' worth)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--steps", "3",
         "--every", "1", "--groups", "2", "--eval-seeds", "4", "--seeds", "1",
         "--modes", "async,async@one", "--redundant", "",
         "--warmup-steps", "5", "--margin", "-1", "--warm-cache", "",
         "--resources", "laptop_engine"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    r = dict(kv.split("=") for kv in line.split()[1:])
    assert (r["ours"], r["resources"]) == ("async", "laptop_engine"), line
    assert (r["pairs_vs_async_at_one"], r["wins_vs_async_at_one"]) in (("1", "0"), ("1", "1")), \
        line
    assert 0 < float(r["speedup_vs_async_at_one_paired"]) < math.inf, line
    assert 0 < float(r["inflight_async"]) <= 2, line  # alpha 1: ≤ 2 steps' worth
    assert 0 < float(r["ttt_async"]) < math.inf, line
