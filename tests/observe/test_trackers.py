"""Experiment trackers, offline: what TensorBoard, MLflow and W&B hold, read back with each
library's own reader, equals ``metrics.jsonl``; a missing package names its extra.

The slow test is the issue's "done means": one real run (``rollart.train`` on a tagged
in-process cluster) with ``report_to`` all three and ``--set`` overrides; then
``rollart samples`` and ``rollart eval`` on the finished run and the decoded
trajectories on the dashboard plugin.
"""

import glob
import json
import math
import struct
import sys
from pathlib import Path

import pytest

from rollart.observe.trackers import TrackerError, make_trackers, scalars

ALL = "tensorboard,mlflow,wandb"


# -- readers: each library's own -----------------------------------------------------------
def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_images(run_dir) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    acc.Reload()
    return acc.Tags()["images"]


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(Path(run_dir) / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("rollart")
    (found,) = client.search_runs([exp.experiment_id])
    run = client.get_run(found.info.run_id)  # every key (a search's run carries ≤ 100)
    metrics = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
               for k in run.data.metrics}
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    return run, metrics, artifacts


def wandb_records(run_dir) -> list:
    """The records of the offline run's ``.wandb`` file, parsed with wandb's own protobuf
    ``Record`` (the file is a LevelDB-style log: a 7-byte ``:W&B`` header, 32 KiB
    blocks of chunks, each ``crc32 | length | type``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
    return out


def wandb_history(run_dir) -> tuple[dict[str, dict[int, float]], dict, list[str]]:
    history: dict[str, dict[int, float]] = {}
    config, images = {}, []
    for rec in wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item}
            step = int(items.pop("_step"))
            for k, v in items.items():
                if k.endswith("/_type") and v == "image-file":
                    images.append(k[:-len("/_type")])
                elif not k.startswith("_") and isinstance(v, (int, float)) and \
                        not k.startswith("reward_plot/"):
                    history.setdefault(k, {})[step] = float(v)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    return history, config, images


def expected(rows) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        for k, v in scalars(r).items():
            out.setdefault(k, {})[r["step"]] = v
    return out


def assert_same(have, want, rel=1e-6):
    assert set(have) == set(want), (sorted(set(want) - set(have)),
                                    sorted(set(have) - set(want)))
    for k, series in want.items():
        assert set(have[k]) == set(series), k
        for step, v in series.items():
            assert have[k][step] == pytest.approx(v, rel=rel, abs=1e-6), (k, step)


# -- fast: the trackers fed a metrics log, without a cluster --------------------------------
ROWS = [{"step": s, "version": s, "time": 1.25 * s, "reward/gridnav": s / 7,
         "success/gridnav": float(s % 2), "traj/trained": 16 * s,
         "trainer/batch_sha1": "ab12", "trainer/kl": float("nan")} for s in range(1, 5)]


def _feed(run_dir, rows=ROWS):
    from rollart.observe.report import MetricsLog, plot_rewards

    trackers = make_trackers(ALL)
    params = {"graph": {"name": "g", "algo": {"lr": 5e-4}, "tasks": ["gridnav"]},
              "resources": {"source": "resources/local.py"}}
    trackers.start(run_dir, "run-x", params)
    log = MetricsLog(run_dir / "metrics.jsonl")
    for r in rows:
        log.write(r)
        trackers.log_step(r["step"], r)
    png = plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    trackers.finish(png)
    assert [t.name for t in trackers.trackers] == ["tensorboard", "mlflow", "wandb"]


def test_three_trackers_hold_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    for k in ("WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(k, raising=False)
    _feed(tmp_path)
    from rollart.observe.report import read_metrics

    want = expected(read_metrics(tmp_path))
    assert "trainer/batch_sha1" not in want and "trainer/kl" not in want  # text, NaN
    assert want["reward/gridnav"][3] == pytest.approx(3 / 7)
    assert_same(tensorboard_scalars(tmp_path), want)
    assert "reward" in tensorboard_images(tmp_path)
    run, metrics, artifacts = mlflow_run(tmp_path)
    assert_same(metrics, want)
    assert run.data.params["graph.algo.lr"] == "0.0005"
    assert run.data.params["resources.source"] == "resources/local.py"
    assert run.info.status == "FINISHED" and "reward.png" in artifacts
    history, config, images = wandb_history(tmp_path)
    assert_same(history, want)
    assert config["graph"]["algo"]["lr"] == 5e-4 and images == ["reward_plot"]
    assert not Path.home().joinpath(".config", "wandb").exists() or \
        not any(Path.home().joinpath(".config", "wandb").iterdir())


def test_missing_package_names_the_extra(monkeypatch, capsys):
    from rollart.app.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now fails
    with pytest.raises(TrackerError, match=r"pip install 'rollart\[mlflow\]'"):
        make_trackers("tensorboard,mlflow")
    assert main(["train", "gridnav", "--report-to", "tensorboard,mlflow"]) == 2
    err = capsys.readouterr().err
    assert "--report-to mlflow needs the mlflow package" in err and "rollart[mlflow]" in err


def test_unknown_tracker_lists_the_known_ones():
    with pytest.raises(TrackerError, match="choose from tensorboard, mlflow, wandb"):
        make_trackers("comet")
    assert not make_trackers(None) and not make_trackers("none")


def test_scalars_keep_only_finite_numbers():
    row = {"step": 2, "a": 1, "b": 0.5, "c": "x", "d": math.inf, "e": True, "f": None}
    assert scalars(row) == {"a": 1.0, "b": 0.5}


# -- slow: one real run, then samples / eval / the dashboard on it --------------------------
def _plugin_samples(dask_scheduler):
    return dask_scheduler.plugins["rollart"].samples


@pytest.mark.slow
def test_one_run_in_every_tracker_then_samples_and_eval(local_cluster, tmp_path, capsys):
    import rollart
    from rollart.app.cli import main
    from rollart.observe.report import read_metrics
    from rollart.types import H800

    g, _ = rollart.load_graph("gridnav")
    run_dir = tmp_path / "run"
    sets = ["steps=3", "algo.group_size=2", "algo.groups_per_step=2", "policy.warmup_steps=3",
            "policy.temperature=0.9", "algo.lr=2e-4", f"rollout.inference_pools={H800}"]
    result = rollart.train(g, client=local_cluster, run_dir=run_dir, overrides=sets,
                           report_to=ALL, eval_seeds=2, progress=True)
    err = capsys.readouterr().err
    assert "rollart: starting the actors" in err and "format warm-up" in err and "3/3" in err
    saved = json.loads((run_dir / "graph.json").read_text())  # --set as graph.json shows
    assert (saved["steps"], saved["algo"]["group_size"], saved["algo"]["lr"]) == (3, 2, 2e-4)
    assert saved["policy"]["temperature"] == 0.9 and saved["rollout"]["inference_pools"] == [H800]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows == result.metrics
    want = expected(rows)
    assert "reward/gridnav" in want and "traj/trained" in want
    assert_same(tensorboard_scalars(run_dir), want)
    run, metrics, artifacts = mlflow_run(run_dir)
    assert_same(metrics, want)
    assert run.data.params["graph.algo.lr"] == "0.0002" and "reward.png" in artifacts
    assert run.data.params["resources.source"] == "the cluster you connected"
    history, config, _ = wandb_history(run_dir)
    assert_same(history, want)
    assert config["graph"]["policy"]["temperature"] == 0.9

    assert main(["samples", str(run_dir), "-n", "1"]) == 0  # decoded turns
    out = capsys.readouterr().out
    assert out.startswith("== gridnav seed ") and "turn 1 observation: gridnav :" in out
    assert "turn 1 action (v" in out and "outcome: " in out
    assert main(["samples", str(run_dir), "--task", "chess"]) == 2
    assert "there are: gridnav" in capsys.readouterr().err

    assert main(["eval", str(run_dir), "--seeds", "2", "--json"]) == 0  # = what train printed
    ev = json.loads(capsys.readouterr().out)
    assert ev["trained"] == result.evaluation["trained"]
    assert ev["warmup"] == result.evaluation["warmup"] and ev["graph"] == "gridnav"
    assert main(["eval", str(run_dir / "model"), "gridnav", "--seeds", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trained"] == result.evaluation["trained"]
    assert main(["eval", str(run_dir / "samples")]) == 2  # not a model folder
    assert "has no config.json" in capsys.readouterr().err

    trajs = local_cluster.run_on_scheduler(_plugin_samples)[run_dir.name]  # the page's
    assert trajs and {t["task"] for t in trajs} == {"gridnav"}
    assert all(t["turns"][0]["observation"].startswith("gridnav") for t in trajs)


def test_start_run_refuses_bad_overrides_and_trackers_before_starting(monkeypatch, tmp_path):
    """``start_run`` returns at once: bad input must raise there, not in its thread."""
    from rollart.app.api import start_run
    from rollart.config.graph import GraphError

    with pytest.raises(GraphError, match="Rollout.redundancy must be a factor"):
        start_run(None, "gridnav", run_dir=tmp_path / "a", overrides=["rollout.redundancy=9"])
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrackerError, match=r"rollart\[wandb\]"):
        start_run(None, "gridnav", run_dir=tmp_path / "b", report_to="wandb")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
