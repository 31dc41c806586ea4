"""A task whose every trajectory fails is stopped after ``Rollout.failing_task_steps``
trainer steps instead of being relaunched for the whole run (``rollart.policy.quarantine``):
one console line names it with its first error, ``rollout/tasks_stopped`` counts it, the
other tasks train on; once every task is stopped the run ends with one error."""

from dataclasses import replace

import pyarrow.compute as pc
import pytest

from rollart import train
from rollart.app.cli import user_errors
from rollart.buffer import read_samples
from rollart.chaos.faults import Faults, with_faults
from rollart.config.graph import GraphError, Rollout
from rollart.control.actors import Actors
from rollart.control.fleet import Fleet
from rollart.control.modes import make_pipeline
from rollart.policy.quarantine import TasksStoppedError
from rollart.testing import check_run_record, tiny_graph


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_task_that_always_fails_is_stopped_and_the_other_trains(local_cluster, tmp_path,
                                                                   caplog, mode):
    broken = with_faults("boxpush", Faults(fail_prob=1.0, seed=0))
    graph = tiny_graph(f"t-stop-{mode}", ("gridnav", broken), mode=mode, steps=8, groups=2,
                       failure_streak_limit=0, failing_task_steps=2)
    with caplog.at_level("WARNING", logger="rollart.control.modes.base"):
        result = train(graph, client=local_cluster, run_dir=tmp_path / mode, progress=False,
                       eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 9))  # the healthy task trained on
    check_run_record(result)
    stopped = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert len(stopped) == 1, stopped
    assert stopped[0].startswith("task 'boxpush' stopped: every trajectory of it failed "
                                 "for 2 trainer steps in a row")
    assert "injected failure" in stopped[0]
    at = next(i for i, r in enumerate(rows) if r["rollout/tasks_stopped"])
    assert at <= 4 and all(r["rollout/tasks_stopped"] == 1 for r in rows[at:])
    # bounded: once its groups in flight ended, no more of its rows arrive
    received = [r["task/received/boxpush"] for r in rows]
    assert received[-1] == received[at + 2] > 0, received
    assert rows[-1]["task/received/gridnav"] > rows[at]["task/received/gridnav"]
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert set(trained["task"].to_pylist()) == {"gridnav"}


def test_the_run_ends_once_every_task_is_stopped():
    """The driver's rule, fed the buffer's per-task counts as ``after_step`` reads them
    (no actor is called in a lockstep mode): the last task stopped raises one error,
    which the CLI prints as one line (rc 2)."""
    graph = tiny_graph("t-all-stopped", ("gridnav", "boxpush"), mode="sync",
                       failing_task_steps=1)
    pipeline = make_pipeline(Fleet(Actors(None, None, [], [])), graph)
    errors = {"gridnav": "RuntimeError: reset broke", "boxpush": "ValueError: no box"}

    def step(gridnav_failed, boxpush_failed):
        pipeline.after_step({"first_errors": errors, "tasks": {
            "gridnav": {"received": 4 * step.n, "failed": gridnav_failed},
            "boxpush": {"received": 4 * step.n, "failed": boxpush_failed}}})
    step.n = 1
    step(4, 1)  # gridnav fails whole: stopped (K = 1); boxpush goes on
    assert pipeline.failing.stopped == ["gridnav"] and not pipeline.sequence.exhausted
    assert {pipeline.next_group()[0].name for _ in range(10)} == {"boxpush"}
    step.n = 2
    with pytest.raises(TasksStoppedError, match="(?s)every task was stopped.*gridnav: "
                                                "RuntimeError: reset broke.*boxpush: "
                                                "ValueError: no box"):
        step(8, 5)
    assert issubclass(TasksStoppedError, user_errors())
    assert pipeline.state()["stopped"] == ["boxpush", "gridnav"]
    with pytest.raises(GraphError, match="failing_task_steps"):
        Rollout(failing_task_steps=-1)


def test_stopped_tasks_survive_a_checkpoint():
    graph = tiny_graph("t-stop-ckpt", ("gridnav", "boxpush"), mode="sync")
    first = make_pipeline(Fleet(Actors(None, None, [], [])), graph)
    first.stop_task("boxpush")
    again = make_pipeline(Fleet(Actors(None, None, [], [])), replace(graph))
    again.load_state(first.state())
    assert again.failing.stopped == ["boxpush"]
    assert {again.next_group()[0].name for _ in range(10)} == {"gridnav"}
