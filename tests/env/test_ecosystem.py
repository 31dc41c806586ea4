"""graphs/ecosystem.py runs end to end for a few steps on the local default: tiny model,
format warm-up on every source, async rollout over the real library envs, trainer steps,
held-out evaluation of every task."""

import json
from dataclasses import replace

import pytest

for lib in ("gymnasium", "textarena", "gem", "reasoning_gym"):
    pytest.importorskip(lib, reason="the ecosystem graph needs rollart[envs]")

from rollart import load_graph, train  # noqa: E402
from rollart.buffer import read_samples  # noqa: E402
from rollart.runtime.resources import load_resources  # noqa: E402

pytestmark = pytest.mark.slow  # ~1-2 min on 2 shared cores


def test_ecosystem_graph_runs_a_few_steps(tmp_path):
    from distributed import Client

    graph, _ = load_graph("ecosystem")
    assert len({t.env_factory.func.__module__ for t in graph.tasks}) >= 4  # ≥ 4 sources
    assert len(set(graph.task_weights)) > 1 and len({t.top_p for t in graph.tasks}) > 1
    graph = replace(graph, steps=2,
                    policy=replace(graph.policy, warmup_steps=2, warmup_batch=8),
                    algo=replace(graph.algo, group_size=2, groups_per_step=3))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=tmp_path / "run", progress=False,
                       eval_seeds=2)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/group_errors"] == 0 for r in rows)
    samples = read_samples(result.run_dir)
    names = set(graph.task_names)
    assert set(samples.column("task").to_pylist()) <= names
    outcomes = samples.column("outcome").to_pylist()
    assert "failed" not in outcomes, samples.filter(
        samples.column("outcome") == "failed").column("error").to_pylist()[:3]
    # every task was played by the trained model in the held-out evaluation
    assert set(result.evaluation["trained"]) == names
