"""``train_briefly``: a graph file trained for two steps on an in-process cluster of the
default pools, checked to have run clean; shared by the graph-file tests of tests/env/
and tests/agents/ (agent, verifiers, MCP, OpenEnv). It sits at tests/, beside
conftest.py, whose folder pytest puts on ``sys.path``."""

import json
from dataclasses import replace
from pathlib import Path


def train_briefly(spec, run_dir, *, steps: int = 2, group_size: int = 2,
                  groups_per_step: int = 4, eval_seeds: int = 3, **policy):
    """Graph ``spec`` (a ``load_graph`` spec) for ``steps`` steps with small groups and
    ``policy`` overrides (default: two warm-up steps of 8), with held-out evaluation.
    Checks every step ran, no group's loop raised and no trajectory failed (the errors
    shown). Returns ``(graph, result, rows)``: the graph as run, the ``RunResult`` and
    the Parquet rows as dicts."""
    from distributed import Client

    from rollart import load_graph, train
    from rollart.buffer import read_samples
    from rollart.runtime.resources import load_resources

    graph, _ = load_graph(spec)
    graph = replace(graph, steps=steps,
                    policy=replace(graph.policy, **{"warmup_steps": 2, "warmup_batch": 8,
                                                    **policy}),
                    algo=replace(graph.algo, group_size=group_size,
                                 groups_per_step=groups_per_step))
    res = replace(load_resources(), processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        result = train(graph, client=client, run_dir=run_dir, progress=False,
                       eval_seeds=eval_seeds)
    metrics = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1)), metrics
    assert all(r["rollout/group_errors"] == 0 for r in metrics)
    rows = read_samples(result.run_dir).to_pylist()
    failed = [r["error"] for r in rows if r["outcome"] == "failed"]
    assert not failed, failed[:3]
    return graph, result, rows
