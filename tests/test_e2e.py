"""End to end: the default multi-task graph trains on a local tagged cluster and the
policy really learns — held-out success rises above the warm-up policy's on every task.

Marked slow (a few minutes on 2 cores); CI runs it.
"""

import json
from dataclasses import replace

import pytest

from rollart import load_graph, train
from rollart.buffer import read_samples
from rollart.buffer.schema import SCHEMA
from rollart.model import load_model
from rollart.resources import cluster_tags, load_resources

# one 80-step training run shared by the module (in-process cluster: ~5 min on 2 cores,
# with room for a slower CI machine). Measured held-out gains at 80 steps: gridnav 0.58,
# guess 0.16, boxpush 0.63 (at 60 steps guess gained only 0.12: too close to the bound)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 80


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from distributed import Client

    graph, _ = load_graph()  # graphs/multitask.py, as `rollart train` runs it
    graph = replace(graph, steps=STEPS)
    res = load_resources()
    res = replace(res, processes=False, dashboard_address=":0")
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    with res.make_cluster() as cluster, Client(cluster) as client:
        tags = cluster_tags(client)
        result = train(graph, client=client, run_dir=run_dir, progress=False, eval_seeds=128)
    return result, tags


def test_reward_rises_above_the_warmup_policy_on_every_task(run):
    result, _ = run
    ev = result.evaluation
    print("held-out success, warm-up -> trained:", ev)
    gains = {t: ev["trained"][t] - ev["warmup"][t] for t in ("gridnav", "guess", "boxpush")}
    # every task clearly better than the warm-up policy (128 held-out seeds: a gain of
    # 0.1 is > 2 standard errors), and a large gain on average
    assert all(g >= 0.1 for g in gains.values()), (gains, ev)
    assert sum(gains.values()) / 3 >= 0.25, (gains, ev)


def test_metrics_log_has_per_task_reward_and_accounting(run):
    result, _ = run
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {"time", "traj/trained", "traj/dropped", "traj/failed", "traj/in_flight",
                "traj/aborted", "traj/cancelled"} <= set(r)
        assert r["trainer/staleness_max"] <= 1  # alpha = 1
        assert r["traj/launched"] == sum(r[f"traj/{s}"] for s in (
            "in_flight", "buffered", "trained", "dropped", "aborted", "cancelled", "failed"))
    assert all(f"reward/{t}" in {k for r in rows for k in r} for t in ("gridnav", "guess",
                                                                       "boxpush"))
    with open(f"{result.run_dir}/metrics.jsonl") as f:
        assert len(f.readlines()) == STEPS


def test_run_directory_outputs(run):
    result, _ = run
    d = result.run_dir
    samples = read_samples(d)
    assert samples.schema.equals(SCHEMA, check_metadata=False)
    assert samples.num_rows >= STEPS * 96
    # rows that left, and (from the buffer's journal) groups still buffered at the end
    assert set(samples.column("state").to_pylist()) <= {"trained", "dropped", "failed",
                                                         "buffered"}
    import os

    assert os.path.getsize(f"{d}/reward.png") > 5000
    load_model(result.model_dir)
    assert json.load(open(f"{d}/eval.json"))["seeds"] == 128


def test_every_actor_ran_on_its_tag(run):
    result, tags = run
    placement = json.load(open(f"{result.run_dir}/placement.json"))
    assert tags[placement["trainer"][0]] == {"TRAIN": 1, "BUFFER": 1}
    assert placement["buffer"] == placement["trainer"]  # off the env pool
    assert {next(iter(tags[a])) for a in placement["inference"]} == {"H800", "H20"}
    assert all(tags[a] == {"CPU_ENV": 1} for a in placement["env"])
