"""Checkpoints and exact resume on a real in-process cluster.

Deterministic setting: sync mode, one env manager, one inference worker serving one
request at a time (batch composition cannot change the numerics), fixed seeds. A run
stopped after step 2 and resumed for one more step must end with the same weights as an
uninterrupted 3-step run, continue its counters and metrics, and train no trajectory
twice. Broken checkpoints are clear errors. Marked slow (three short training runs).
"""

import contextlib
import io
import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rollart import GRPO, Graph, Policy, Rollout, train
from rollart.control import checkpoint as ck
from rollart.buffer import read_samples
from rollart.app.cli import main
from rollart.types import H800

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def graph(tiny_model):
    return Graph(name="ckpt", tasks=("gridnav",), mode="sync", steps=STEPS, seed=7,
                 policy=Policy(model=str(tiny_model), warmup_steps=0, max_batch=1),
                 algo=GRPO(group_size=2, groups_per_step=2, kl_coef=0.05, lr=5e-3),
                 rollout=Rollout(inference_pools=(H800,)))


@pytest.fixture(scope="module")
def runs(local_cluster, graph, tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    kw = dict(client=local_cluster, progress=False, eval_seeds=0)
    full = train(graph, run_dir=base / "full", checkpoint_every=2, **kw)
    first = train(replace(graph, steps=2), run_dir=base / "split", **kw)
    first_rows = list(first.metrics)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        resumed = train(graph, resume=base / "split", steps=STEPS, **kw)
    resumed.said = said.getvalue()
    return full, first_rows, resumed


def test_a_resume_says_where_it_resumed(runs):
    said = runs[2].said
    assert "from its checkpoint of step 2 (policy version 2" in said, said
    assert "training goes on from step 3" in said


def _weights(result):
    return load_file(f"{result.model_dir}/model.safetensors")


def test_resume_after_step_k_equals_the_uninterrupted_run(runs):
    full, _, resumed = runs
    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    init = load_file(f"{full.run_dir}/checkpoints/step-00000002/model/model.safetensors")
    assert any(not torch.allclose(init[k], a[k]) for k in a)  # step 3 did change them


def test_counters_and_metrics_continue_the_curve(runs):
    full, first_rows, resumed = runs
    rows = resumed.metrics
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]
    for old, new in zip(first_rows, rows[:2]):  # the original run's rows, kept
        assert {k: new[k] for k in ("step", "time", "reward/gridnav")} == \
            {k: old[k] for k in ("step", "time", "reward/gridnav")}
    assert rows[2]["time"] > rows[1]["time"]
    for key in ("reward/gridnav", "traj/trained", "traj/launched", "trainer/loss"):
        assert rows[2][key] == pytest.approx(full.metrics[2][key], rel=1e-4, abs=1e-6), key
    assert rows[2]["traj/trained"] == 3 * 4
    on_disk = [json.loads(line) for line in open(f"{resumed.run_dir}/metrics.jsonl")]
    assert [r["step"] for r in on_disk] == [1, 2, 3]


def test_no_trajectory_is_trained_twice(runs):
    _, _, resumed = runs
    table = read_samples(resumed.run_dir).to_pylist()
    trained = [r for r in table if r["state"] == "trained"]
    ids = [r["traj_id"] for r in trained]
    assert len(ids) == len(set(ids)) == 3 * 4
    assert sorted({r["trained_step"] for r in trained}) == [1, 2, 3]


def test_checkpoint_contents(runs):
    full, _, _ = runs
    url = f"{full.run_dir}/checkpoints"
    assert ck.steps(url) == [2, 3]
    c = ck.load(ck.latest(url))
    assert (c.step, c.version) == (3, 3)
    assert {"model/model.safetensors", "model/tokenizer.json", "trainer.pt",
            "ref_model.safetensors", "buffer.parquet", "buffer.json", "state.json",
            "graph.json", "resources.json"} <= set(c.files) | {"manifest.json"}
    assert c.graph["mode"] == "sync" and c.graph["algo"]["group_size"] == 2
    assert c.resources["trainer"] and c.state["pipeline"]["n_groups"] == 3 * 2


def test_corrupt_and_missing_checkpoints_are_clear_errors(runs, tmp_path, capsys):
    full, _, _ = runs
    src = ck.latest(f"{full.run_dir}/checkpoints")
    broken = tmp_path / "checkpoints" / "step-00000003"
    shutil.copytree(src, broken)
    with open(broken / "trainer.pt", "r+b") as f:  # flip bytes in the optimizer state
        f.seek(100)
        f.write(b"\x00\xff" * 8)
    with pytest.raises(ck.CheckpointError, match="trainer.pt is corrupt"):
        ck.load(str(broken))
    (broken / "buffer.parquet").unlink()
    with pytest.raises(ck.CheckpointError, match="buffer.parquet is missing"):
        ck.load(str(broken))
    (broken / "COMPLETE").unlink()
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.load(str(broken))
    assert ck.latest(str(tmp_path / "checkpoints")) is None  # incomplete ones are skipped
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.for_resume(tmp_path)
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load(str(tmp_path / "nowhere"))
    assert main(["train", "--resume", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart: error:") and "no complete checkpoint" in err
