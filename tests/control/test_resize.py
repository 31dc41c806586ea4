"""``Run.scale("trainer", M)`` (``rollart.control.resize``): the trainer's pool of a
running job grows and shrinks at step boundaries, the trainer going from one process to
a two-rank gang, a three-rank one and back to one process with its state: every step row
says how many ranks trained it, the version goes on one a step, nothing is lost or
trained twice (``check_run_record``), and the AdamW moments survive every move (their
step count is the run's). What it cannot become is refused with what to do, decided
without a cluster."""

import json
import re
from dataclasses import replace
from itertools import groupby

import pytest


@pytest.mark.slow
def test_the_trainer_pool_goes_1_2_3_1_mid_run_with_the_trainers_state(tmp_path):
    import torch
    from distributed import Client

    from rollart.app.api import start_run, wait_for_step
    from rollart.runtime.resources import load_resources
    from rollart.testing import check_run_record, tiny_graph

    graph = tiny_graph("t-resize", steps=9, groups=2, size=2)
    graph = replace(graph, algo=replace(graph.algo, kl_coef=0.05))  # a KL reference too
    res = replace(load_resources(), dashboard_address=":0")  # worker processes: a gang
    with res.make_cluster() as cluster, Client(cluster) as client:
        run = start_run(client, graph, run_dir=tmp_path / "run")
        for step, n in ((2, 2), (4, 3), (6, 1)):
            wait_for_step(run, step, 600)
            assert not run.done(), run.error
            run.scale("trainer", n)
        result = run.wait(timeout=600)
        assert sorted(n for n in cluster.worker_spec if n.startswith("trainer-")) == \
            ["trainer-0"]
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 10))
    ranks = [r["trainer/ranks"] for r in rows]
    assert [k for k, _ in groupby(ranks)] == [1, 2, 3, 1], ranks
    versions = [r["version"] for r in rows]
    assert versions == list(range(versions[0], versions[0] + 9)), versions
    assert all(torch.isfinite(torch.tensor(r["trainer/loss"])) for r in rows), rows
    check_run_record(result)
    events = [e for e in json.loads((tmp_path / "run" / "recovery.json").read_text())
              if e.get("kind") == "scale"]
    assert [(e["pool"], e["from"], e["to"], e["ranks"]) for e in events] == \
        [("trainer", 1, 2, [1, 2]), ("trainer", 2, 3, [2, 3]),
         ("trainer", 3, 1, [3, 1])], events
    assert events[0]["added"] == ["trainer-1"] and events[1]["added"] == ["trainer-2"]
    assert len(events[2]["removed"]) == 2, events[2]
    # the run's last checkpoint (one process again): AdamW counted every step, so its
    # moments were carried through every resize, never started again; the KL
    # reference went along
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000009"
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {9.0}, steps
    assert (ckpt / "ref_model.safetensors").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("resize-*"))


@pytest.mark.parametrize("policy,n,fix", [
    ({}, 0, "runs 1 worker or more, not 0"),
    ({"trainer_backend": "megatron"}, 2, "`rollart train --resume RUN`"),
    ({"lora": {"rank": 4}}, 2, "LoRA trains on one TRAIN worker"),
    ({}, 2, "a trainer gang needs a process per rank"),
])
def test_what_the_trainer_pool_cannot_become_is_refused_with_what_to_do(policy, n, fix):
    """No cluster: the refusals are decided from the graph and the pool's specs (a
    ``Worker`` spec: a thread of the driver's process, ``Resources(processes=False)``)."""
    from types import SimpleNamespace

    from distributed import Worker

    from rollart.control.resize import resize_trainer
    from rollart.control.scaling import ScaleError
    from rollart.testing import tiny_graph

    spec = {"trainer-0": {"cls": Worker, "options": {"resources": {"TRAIN": 1}}}}
    scaler = SimpleNamespace(
        fleet=SimpleNamespace(stages=SimpleNamespace(graph=tiny_graph(policy=policy))),
        client=SimpleNamespace(cluster=SimpleNamespace(worker_spec=spec)))
    with pytest.raises(ScaleError, match=re.escape(fix)):
        resize_trainer(scaler, "trainer", {"trainer-0": "tcp://w:1"}, ["tcp://w:1"], n, 3)
