"""``Run.scale("trainer", M)`` (``rollart.control.resize``): the trainer's pool of a
running job grows and shrinks at step boundaries, the trainer going from one process to a
two-rank gang and back with its state: every step row says how many ranks trained it,
the version goes on one a step, nothing is lost or trained twice (``check_run_record``),
and the AdamW moments survive both moves (their step count is the run's)."""

import json
from dataclasses import replace
from itertools import groupby

import pytest

pytestmark = pytest.mark.slow


def test_the_trainer_pool_goes_1_2_1_mid_run_with_the_trainers_state(tmp_path):
    import torch
    from distributed import Client

    from rollart.app.api import start_run, wait_for_step
    from rollart.runtime.resources import load_resources
    from rollart.testing import check_run_record, tiny_graph

    graph = tiny_graph("t-resize", steps=8, groups=2, size=2)
    graph = replace(graph, algo=replace(graph.algo, kl_coef=0.05))  # a KL reference too
    res = replace(load_resources(), dashboard_address=":0")  # worker processes: a gang
    with res.make_cluster() as cluster, Client(cluster) as client:
        run = start_run(client, graph, run_dir=tmp_path / "run")
        for step, n in ((2, 2), (5, 1)):
            wait_for_step(run, step, 600)
            assert not run.done(), run.error
            run.scale("trainer", n)
        result = run.wait(timeout=600)
        assert sorted(n for n in cluster.worker_spec if n.startswith("trainer-")) == \
            ["trainer-0"]
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 9))
    ranks = [r["trainer/ranks"] for r in rows]
    assert [k for k, _ in groupby(ranks)] == [1, 2, 1], ranks
    versions = [r["version"] for r in rows]
    assert versions == list(range(versions[0], versions[0] + 8)), versions
    assert all(torch.isfinite(torch.tensor(r["trainer/loss"])) for r in rows), rows
    check_run_record(result)
    events = [e for e in json.loads((tmp_path / "run" / "recovery.json").read_text())
              if e.get("kind") == "scale"]
    assert [(e["pool"], e["from"], e["to"], e["ranks"]) for e in events] == \
        [("trainer", 1, 2, [1, 2]), ("trainer", 2, 1, [2, 1])], events
    assert events[0]["added"] == ["trainer-1"] and len(events[1]["removed"]) == 1
    # the run's last checkpoint (one process again): AdamW counted every step, so its
    # moments were carried through both resizes, never started again; the KL
    # reference went along
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000008"
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {8.0}, steps
    assert (ckpt / "ref_model.safetensors").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("resize-*"))
