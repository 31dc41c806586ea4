"""``Run.scale(pool, n)`` (``rollart.control.scaling``): a pool of the cluster rollart
made grows and shrinks between trainer steps of a running job. Workers that join get an
actor and work within a couple of steps; workers that leave are drained first (their
groups finish there), so the run loses nothing: ``check_run_record`` audits the Parquet
rows against the trainer's batches, and no member failed with a lost worker."""

import json
import time
from dataclasses import replace

import pytest

from rollart.control.scaling import ScaleError, request_scale

pytestmark = pytest.mark.slow


def _cluster():
    from rollart.runtime.resources import load_resources

    return replace(load_resources(), processes=False, dashboard_address=":0").make_cluster()


def _managers(client) -> dict[str, int]:
    """Worker address -> groups its env manager took (read on the workers)."""
    def probe(dask_worker):
        return [a.counts["groups_taken"] for a in dask_worker.state.actors.values()
                if type(a).__name__ == "EnvManager"]
    return {a: sum(v) for a, v in client.run(probe).items() if v}


def _wait(run, step: int, timeout: float = 300) -> None:
    from rollart.app.api import wait_for_step

    wait_for_step(run, step, timeout)
    assert not run.done() or run.error is None, run.error


def test_an_env_and_an_inference_pool_grow_and_shrink_mid_run_losing_nothing(tmp_path):
    from distributed import Client

    from rollart.app.api import start_run
    from rollart.app.cli import main
    from rollart.chaos.faults import Faults, Latency, with_faults
    from rollart.testing import check_run_record, tiny_graph

    # env steps of 50 ms: a step lasts long enough that the run is still going when the
    # new worker has joined (about 2 s after the request); with instant envs a fast
    # default ran most of its steps before that, and the new manager had nothing to take
    slow = with_faults("gridnav", Faults(step=Latency("fixed", 0.05)))
    graph = tiny_graph("t-scale", (slow,), steps=16, groups=2, size=2)
    with _cluster() as cluster, Client(cluster) as client:
        run = start_run(client, graph, run_dir=tmp_path / "run")
        _wait(run, 2)
        before = set(_managers(client))
        run.scale("env", 2)
        # from another shell: the request travels as a Dask event to the run's driver
        assert main(["scale", str(tmp_path / "run"), "infer-h20=2", "--scheduler",
                     cluster.scheduler_address]) == 0
        # applied before the next step; the new manager joins and is given groups
        deadline = time.monotonic() + 120
        while True:
            grown = _managers(client)
            new = set(grown) - before
            if (len(new) == 1 and grown[next(iter(new))] > 0) or run.done() or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(new) == 1, (before, grown)
        assert grown[new.pop()] > 0, grown  # the new manager was given groups
        assert not run.done(), "the run ended before the new manager took a group"
        run.scale("env", 1)
        run.scale("CPU_ENV", 1)  # by tag: already 1, nothing to do
        run.scale("infer-h20", 1)
        result = run.wait(timeout=300)
        assert len(client.scheduler_info()["workers"]) == 5  # the retired ones left
        from rollart.observe.dashboard.status import fetch_state

        marks = fetch_state(client)["run"]["scales"]  # the dashboard's marks
        assert sorted(n for n in cluster.worker_spec if n.startswith("env-")) == ["env-0"]
    assert [r["step"] for r in result.metrics] == list(range(1, 17))
    check_run_record(result)
    assert result.final_counts["orphaned"] == 0, result.final_counts  # drained, not lost
    events = [e for e in json.loads((tmp_path / "run" / "recovery.json").read_text())
              if e.get("kind") == "scale"]
    moves = [(e["pool"], e["from"], e["to"]) for e in events]
    assert moves == [("env", 1, 2), ("infer-h20", 1, 2), ("env", 2, 1), ("CPU_ENV", 1, 1),
                     ("infer-h20", 2, 1)], moves
    assert not events[3]["added"] and not events[3]["removed"]
    assert [(m["pool"], m["step"]) for m in marks] == [(e["pool"], e["step"]) for e in events]
    assert events[0]["added"] == ["env-1"] and len(events[2]["removed"]) == 1
    assert events[2]["groups_left"] == 0, events[2]


def test_what_cannot_be_scaled_is_refused_with_what_to_do(tmp_path, capsys):
    from distributed import Client

    from rollart.app.api import start_run
    from rollart.app.cli import main
    from rollart.testing import tiny_graph

    with pytest.raises(ScaleError, match="0 or more"):
        request_scale("x", "env", -2)
    graph = tiny_graph("t-scale-refused", steps=4, groups=2, size=2)
    with _cluster() as cluster, Client(cluster) as client:
        run = start_run(client, graph, run_dir=tmp_path / "run")
        _wait(run, 1)
        run.scale("trainer", 2)  # a gang needs a process per rank (test_resize: it grows)
        run.scale("trainer", 0)
        run.scale("env", 0)
        run.scale("gpu-pool", 1)
        assert main(["scale", "no-such-run", "env=2", "--scheduler",
                     cluster.scheduler_address]) == 2
        assert main(["scale", "t-scale-refused", "env=two", "--scheduler",
                     cluster.scheduler_address]) == 2
        result = run.wait(timeout=300)
        assert len(cluster.worker_spec) == 5
    out = capsys.readouterr().err  # rollart's progress lines
    assert "scale trainer=2 refused: the cluster's workers are threads of one process " \
        "(Resources(processes=False)): a trainer gang needs a process per rank" in out
    assert "scale trainer=0 refused: the trainer's pool runs 1 worker or more" in out
    assert "scale env=0 refused: the run's tasks use the CPU_ENV pool: it may shrink to 1" \
        in out
    assert "scale gpu-pool=1 refused: no pool 'gpu-pool': name one of env, infer-h20, " \
        "infer-h800, reward, trainer" in out
    assert "no live run named 'no-such-run'" in out and "write POOL=N" in out
    assert len(result.metrics) == 4 and not [e for e in result.recovery if e.get("kind")]


def test_a_worker_started_by_hand_joins_an_inference_pool_and_is_retired_by_tag(tmp_path):
    """``dask worker SCHEDULER --resources H20=1``, started by hand mid-run, gets an
    inference worker and serves requests; ``run.scale("H20", 1)`` then drains and
    retires it (the newest of the pool: not one of the cluster's own), losing nothing."""
    import os
    import subprocess
    import sys

    from distributed import Client

    from rollart.app.api import start_run
    from rollart.testing import check_run_record, tiny_graph

    graph = tiny_graph("t-scale-hand", steps=40, groups=2, size=2)
    with _cluster() as cluster, Client(cluster) as client:
        run = start_run(client, graph, run_dir=tmp_path / "run")
        _wait(run, 1)
        hand = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
             "--resources", "H20=1", "--nthreads", "1", "--no-nanny", "--name", "by-hand",
             "--no-dashboard"], env={**os.environ, "DASK_LOGGING__DISTRIBUTED": "warning"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 240
            served = 0
            while not served:
                assert time.time() < deadline, "the hand-started worker served nothing"
                assert not run.done(), run.error
                served = _served(client, "by-hand")
                time.sleep(0.5)
            run.scale("H20", 1)
            result = run.wait(timeout=600)
            assert hand.wait(timeout=60) == 0  # retired: it exits on its own
        finally:
            if hand.poll() is None:
                hand.kill()
    check_run_record(result)
    assert result.final_counts["orphaned"] == 0, result.final_counts
    shrink = [e for e in result.recovery if e.get("kind") == "scale"]
    assert [(e["pool"], e["from"], e["to"]) for e in shrink] == [("H20", 2, 1)], shrink
    assert shrink[0]["requests_left"] == 0, shrink


def _served(client, name: str) -> int:
    """Requests served by the inference worker on the worker named ``name``."""
    def probe(dask_worker):
        if dask_worker.name != name:
            return 0
        return sum(a.engine.requests for a in dask_worker.state.actors.values()
                   if type(a).__name__ == "InferenceWorker")
    try:
        return sum(client.run(probe).values())
    except Exception:  # noqa: BLE001 - a worker joining or leaving mid-probe
        return 0


def test_an_adapting_env_pool_grows_under_load_within_its_bounds(tmp_path):
    """``Pool("env", ..., adapt=(1, 2))``: slow env steps keep more env calls waiting than
    the manager has threads, so the pool grows to 2 (not past it) between steps, with the
    reason in its event; the run's rows still audit clean. Once it has grown, rollout may
    be bound by the in-flight limit rather than the envs: a pressure under ``Demand.LOW``
    for ``SHRINK_AFTER`` steps then shrinks it back (the rule, not a fault), one worker
    at a time and never under 1; the cluster ends with the workers the last event says."""
    from distributed import Client

    from rollart.app.api import start_run
    from rollart.chaos.faults import Faults, Latency, with_faults
    from rollart.runtime.resources import load_resources
    from rollart.testing import check_run_record, tiny_graph

    res = load_resources()
    pools = tuple(replace(p, adapt=(1, 2)) if p.name == "env" else p for p in res.pools)
    res = replace(res, pools=pools, processes=False, dashboard_address=":0")
    # env steps slow enough that the envs, not generation or the trainer, bound rollout
    # on a loaded 2-core runner too (at 0.2 s, CI once measured no pressure and no growth)
    slow = with_faults("gridnav", Faults(step=Latency("fixed", seconds=0.5)))
    graph = tiny_graph("t-adapt", [slow], steps=8, groups=8, size=4)
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = start_run(client, graph, run_dir=tmp_path / "run").wait(timeout=600)
        env_workers = sorted(n for n in cluster.worker_spec if n.startswith("env-"))
    events = [e for e in result.recovery if e.get("kind") == "scale"]
    moves = [(e["pool"], e["from"], e["to"]) for e in events]
    assert moves and moves[0] == ("env", 1, 2), events  # it grew first, under load
    for (pool, n, to), (_, _, before) in zip(moves, [("env", 1, 1)] + moves):
        assert pool == "env" and n == before and abs(to - n) == 1 and 1 <= to <= 2, events
    assert all(e["reason"].startswith("pressure ") for e in events), events
    assert len(env_workers) == moves[-1][2], (env_workers, events)
    check_run_record(result)


def test_adapt_bounds_are_checked():
    from rollart.runtime.resources import Pool, ResourcesError

    with pytest.raises(ResourcesError, match=r"1 <= min <= workers \(1\) <= max"):
        Pool("env", tag="CPU_ENV", kind="cpu_env", adapt=(2, 3))
    with pytest.raises(ResourcesError, match="not a trainer pool"):
        Pool("t", tag="TRAIN", kind="trainer", adapt=(1, 2))
    assert Pool("env", tag="CPU_ENV", kind="cpu_env", adapt=[1, 3]).adapt == (1, 3)


def test_the_module_examples_hold():
    """``Demand``'s hysteresis and ``spec_tag``'s spec forms, as their docstrings show."""
    import doctest

    import rollart.control.scaling as scaling

    assert doctest.testmod(scaling).failed == 0


def test_a_jobqueue_cluster_names_its_pools_by_tag():
    """``resources/jobqueue.py``'s ``SLURMCluster`` (no SLURM: nothing submitted) tags each
    job through ``--resources TAG=1``: a scale request by tag finds that pool's jobs, the
    copies ``_grow`` would submit included."""
    pytest.importorskip("dask_jobqueue", reason="needs the jobqueue extra")
    from pathlib import Path

    from rollart.control.scaling import spec_tag
    from rollart.runtime.resources import ResourcesError, load_module

    mod = load_module(Path(__file__).resolve().parents[2] / "resources" / "jobqueue.py",
                      ResourcesError)
    cluster = mod.slurm_cluster(submit=False, host="127.0.0.1", dashboard_address=":0")
    try:
        tags = {name: spec_tag(s) for name, s in cluster.worker_spec.items()}
    finally:
        cluster.close()
    assert tags and all(tag == name.rsplit("-", 1)[0] for name, tag in tags.items()), tags
    assert sorted(set(tags.values())) == sorted(mod.POOLS)
