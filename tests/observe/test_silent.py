"""Nothing silent (issue 39): every task keeps its keys in every step row, and a task that
trains on nothing (or never calls the tools its env declares) is named once when it
starts and once when it recovers (``rollart.observe.silent``).

Pure logic first; then a short run (~5 s) of a real in-process cluster whose second task
always gets the same reward (so none of its groups is trainable)."""

import doctest
import json
import logging
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollart import GRPO, Graph, Policy, Rollout, train
from rollart.buffer.arrivals import Arrivals
from rollart.buffer.schema import SCHEMA, from_table, read_parts, to_record_batch
from rollart.config.graph import GraphError
from rollart.env.tasks import get_task
from rollart.observe.figures import step_row
from rollart.observe.metrics import TOPIC, RunState, fold
from rollart.observe.silent import SilentTasks
from rollart.observe.trackers import scalars
from rollart.types import Trajectory


def test_doctests():
    import rollart.buffer.arrivals
    import rollart.buffer.schema
    import rollart.observe.figures
    import rollart.observe.silent

    for module in (rollart.observe.silent, rollart.observe.figures, rollart.buffer.arrivals,
                   rollart.buffer.schema):
        assert doctest.testmod(module).failed == 0


def _row(step, **per_task):
    """A row with ``trainer/trainable_groups/<task>`` = n for each ``task=n``."""
    return {"step": step, **{f"trainer/trainable_groups/{t}": n for t, n in per_task.items()}}


def test_a_task_is_named_after_k_untrainable_steps_once_and_again_when_it_recovers():
    w = SilentTasks(["a", "b"], steps=3)
    notes = [w.update(_row(s, a=1, b=0)) for s in range(1, 7)]
    assert [len(n) for n in notes] == [0, 0, 1, 0, 0, 0]  # at step K, then never again
    (n,) = notes[2]
    assert (n.task, n.reason, n.active) == ("b", "untrainable", True)
    assert "'b'" in n.text and "3 steps" in n.text and "to step 3" in n.text
    (back,) = w.update(_row(7, a=1, b=2))
    assert (back.task, back.active) == ("b", False) and "recovered at step 7" in back.text
    assert w.update(_row(8, a=1, b=2)) == []
    # a missing key counts as none trainable; K=0 never warns
    assert [n.task for s in range(1, 4) for n in w.update({"step": 8 + s})] == ["a", "b"]
    quiet = SilentTasks(["a"], steps=0)
    assert all(quiet.update(_row(s, a=0)) == [] for s in range(1, 20))


def test_a_task_offered_tools_that_never_calls_one_is_named():
    w = SilentTasks(["calc", "agent"], steps=2, exempt=["agent"])

    def step(s, received, calls, offered):
        row = _row(s, calc=1, agent=1)
        per_task = {}
        for t in ("calc", "agent"):
            row.update({f"task/received/{t}": received, f"task/tool_calls/{t}": calls})
            per_task[t] = {"tools_offered": offered}
        return w.update(row, per_task)

    assert step(1, 4, 0, 4) == []
    (n,) = step(2, 8, 0, 8)  # two steps of arrivals offered tools, no call: named once
    assert (n.task, n.reason) == ("calc", "no_tool_calls") and "declares tools" in n.text
    assert step(3, 8, 0, 8) == []  # nothing arrived: no evidence, no repeat
    assert step(4, 12, 0, 12) == []
    (back,) = step(5, 16, 3, 16)
    assert (back.task, back.reason, back.active) == ("calc", "no_tool_calls", False)
    tools_never_offered = SilentTasks(["plain"], steps=1)
    row = {**_row(1, plain=1), "task/received/plain": 4, "task/tool_calls/plain": 0}
    assert tools_never_offered.update(row, {"plain": {"tools_offered": 0}}) == []


def test_the_dashboard_keeps_a_warning_while_it_lasts():
    w = SilentTasks(["b"], steps=1)
    state = RunState("r")
    (n,) = w.update(_row(1, b=0))
    state.ingest(n.message("r"))
    assert state.summary()["warnings"] == [n.text]
    (back,) = w.update(_row(2, b=1))
    state.ingest(back.message("r"))
    assert state.summary()["warnings"] == []


class _Sample:
    def __init__(self, per_task):
        self.buffer = {"launched": 0, "tasks": per_task,
                       **{k: 0 for k in ("in_flight", "buffered", "taken", "trained",
                                         "dropped", "aborted", "cancelled", "failed",
                                         "lost_in_step")}}
        self.workers, self.managers = [], []


def test_every_task_has_its_keys_in_a_row_even_with_nothing_in_the_batch():
    trainer = {"reward/a": 0.5, "success/a": 1.0, "trainer/rows/a": 4,
               "trainer/trainable_groups/a": 1}
    row = step_row(trainer, _Sample({"a": {"received": 4, "truncated": 1}}), elapsed=1.0,
                   tasks=["a", "b"])
    assert row["reward/a"] == 0.5 and row["task/truncated/a"] == 1
    assert row["reward/b"] is None and row["success/b"] is None
    assert row["trainer/rows/b"] == row["trainer/trainable_groups/b"] == 0
    assert row["task/failed/b"] == row["task/invalid_tool_calls/b"] == 0
    assert row["task/tool_calls/b"] == 0
    json.dumps(row, allow_nan=False)  # null, never NaN
    got = scalars(row)  # what TensorBoard, MLflow and W&B are given: no null
    assert "reward/b" not in got and got["trainer/rows/b"] == 0.0


def test_per_task_counts_continue_in_a_recovered_buffer():
    """``SampleBuffer._meta`` journals ``Arrivals.record()``; a recovered buffer loads it."""
    a = Arrivals()
    a.received(Trajectory("t-0", "calc", "g", 0, [], [], [], [], [], outcome="failed",
                          tool_calls=2, invalid_tool_calls=2))
    b = Arrivals()
    b.load(json.loads(json.dumps(a.record())))
    assert b.tasks() == a.tasks() and b.tasks()["calc"]["invalid_tool_calls"] == 1
    assert b.counts() == a.counts()


def test_rows_of_schema_version_1_read_with_null_tool_counts(tmp_path):
    row = pa.Table.from_batches([to_record_batch([Trajectory(
        "t-0", "a", "g", 0, [1], [2], [1], [0.0], [0], tool_calls=2, invalid_tool_calls=1)])])
    (tmp_path / "samples").mkdir()
    pq.write_table(row.drop_columns(["tool_calls", "invalid_tool_calls"]),
                   tmp_path / "samples" / "part-00000.parquet")
    table = read_parts(tmp_path)
    assert table.schema.names == SCHEMA.names and table.num_rows == 1
    (t,) = from_table(table)
    assert (t.traj_id, t.tool_calls, t.invalid_tool_calls) == ("t-0", None, None)


def test_silent_task_steps_is_validated():
    with pytest.raises(GraphError, match="silent_task_steps must be an int ≥ 0"):
        Rollout(silent_task_steps=-1)
    with pytest.raises(GraphError, match="silent_task_steps must be an int"):
        Rollout(silent_task_steps=2.5)


# -- a real run ---------------------------------------------------------------------------
def same_reward(episode):
    """Every trajectory gets 0.5: no group of this task is ever trainable."""
    return 0.5


def test_a_run_names_the_task_whose_groups_never_train(local_cluster, tmp_path, caplog):
    flat = replace(get_task("gridnav"), name="flat", reward_fn=same_reward)
    graph = Graph(name="t-silent", tasks=("gridnav", flat), steps=4,
                  policy=Policy(warmup_steps=0), algo=GRPO(group_size=2, groups_per_step=2),
                  rollout=Rollout(silent_task_steps=2))
    with caplog.at_level(logging.WARNING, logger="rollart.control.loop"):
        result = train(graph, client=local_cluster, run_dir=tmp_path / "run",
                       progress=False, eval_seeds=0)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows == result.metrics
    keys = [f"{k}/{t}" for t in ("gridnav", "flat") for k in (
        "reward", "success", "trainer/rows", "trainer/trainable_groups",
        "task/received", "task/failed", "task/truncated", "task/invalid_tool_calls",
        "task/tool_calls")]
    for r in rows:
        assert all(k in r for k in keys), [k for k in keys if k not in r]
        # no key is also the folder of others (MLflow's file store keeps each key as a
        # file path: trainer/batch_size beside trainer/batch_size/<task> lost the rest)
        assert not [k for k in r if any(o.startswith(k + "/") for o in r)]
        assert r["trainer/trainable_groups/flat"] == 0
        assert r["reward/flat"] in (None, 0.5)
        assert r["trainer/rows/flat"] + r["trainer/rows/gridnav"] == 4
    named = [rec.getMessage() for rec in caplog.records
             if "'flat' produced no trainable group" in rec.getMessage()]
    assert len(named) == 1 and "for 2 steps (to step 2)" in named[0], caplog.text
    # the same notice reached the scheduler, where the dashboard's RunState keeps it
    events = [m for _, m in local_cluster.get_events(TOPIC) if m.get("run") == "run"]
    warned = [m for m in events if m["kind"] == "warning" and m["task"] == "flat"]
    assert [(m["reason"], m["active"]) for m in warned] == [("untrainable", True)]
    assert any("'flat'" in w for w in fold(events)["run"].summary()["warnings"])
