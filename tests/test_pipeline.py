"""The three modes end to end, briefly, on a local tagged cluster: counts add up at every
step, no trained token is older than the mode's bound, redundant extras and stale
members never reach the trainer."""

from dataclasses import replace

import pyarrow.compute as pc
import pytest

from rollart import GRPO, Graph, Policy, Rollout, train
from rollart.buffer import read_samples
from rollart.buffer.ledger import STATES
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.faults import Faults, Latency, with_faults
from rollart.env.tasks import get_task
from rollart.graph import GraphError

pytestmark = pytest.mark.slow


def _graph(mode, **rollout):
    tasks = tuple(with_faults(t, Faults(step=Latency("lognormal", 0.005, sigma=1.0)))
                  for t in ("gridnav", "boxpush"))
    return Graph(name=f"t-{mode}", tasks=tasks, mode=mode, steps=4,
                 policy=Policy(warmup_steps=10),
                 algo=GRPO(group_size=2, groups_per_step=3),
                 rollout=Rollout(**rollout))


def _check_run(result, alpha):
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert sum(r[f"traj/{s}"] for s in STATES) == r["traj/launched"]
        assert r["trainer/staleness_max"] <= alpha
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    # the trainer holds version s - 1 at step s: no trained token older than s - 1 - alpha
    ok = pc.greater_equal(trained["version"], pc.subtract(trained["trained_step"], 1 + alpha))
    assert pc.all(ok).as_py()
    assert trained.num_rows == 4 * 3 * 2
    return rows


@pytest.mark.parametrize("mode, alpha", [("sync", 0), ("one-off", 1)])
def test_baseline_modes_train(local_cluster, tmp_path, mode, alpha):
    result = train(_graph(mode), client=local_cluster, run_dir=tmp_path / mode,
                   progress=False, eval_seeds=0)
    rows = _check_run(result, alpha)
    assert all(r["traj/cancelled"] == 0 and r["traj/aborted"] == 0 for r in rows)


def test_async_mode_with_redundancy_cancels_extras(local_cluster, tmp_path):
    result = train(_graph("async", redundancy=2.0), client=local_cluster,
                   run_dir=tmp_path / "async", progress=False, eval_seeds=0)
    rows = _check_run(result, 1)
    assert rows[-1]["traj/cancelled"] > 0
    samples = read_samples(result.run_dir)
    # cancelled extras never reach the buffer, let alone the trainer
    assert "cancelled" not in set(samples["state"].to_pylist())


def test_modes_imply_their_bound():
    assert replace(_graph("sync"), mode="sync").algo.alpha == 0
    assert _graph("one-off").algo.alpha == 1
    with pytest.raises(GraphError, match="mode"):
        replace(_graph("sync"), mode="fast")
    with pytest.raises(GraphError, match="redundancy"):
        Rollout(redundancy=0.5)


def test_accounting_holds_under_injected_failures_and_hangs(local_cluster, tmp_path):
    faults = Faults(step=0.002, fail_prob=0.05, hang_prob=0.03, hang_seconds=30.0, seed=3)
    graph = replace(_graph("async", redundancy=1.5, env_step_timeout=0.5),
                    tasks=tuple(with_faults(t, faults) for t in ("gridnav", "guess")))
    result = train(graph, client=local_cluster, run_dir=tmp_path / "faulty", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    for r in rows:
        assert sum(r[f"traj/{s}"] for s in STATES) == r["traj/launched"]
    assert rows[-1]["traj/failed"] > 0  # injected crashes and hangs (time-outs) happened
    samples = read_samples(result.run_dir)
    errors = samples.filter(pc.equal(samples["state"], "failed"))["error"].to_pylist()
    assert any("injected failure" in e for e in errors)
    assert any("env_step_timeout" in e for e in errors)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert 0 < trained.num_rows <= 4 * 3 * 2  # failed members are never trained on


# Runs that cannot make progress stop with an error that says why, instead of spinning:
# every trajectory failing (a broken env) is a failure storm; trajectories that wait
# forever (env steps that hang, with no step time-out to catch them) are a stall.
STOPS = {
    "storm": (Faults(fail_prob=1.0, seed=0), {"failure_streak_limit": 12},
              "FailureStormError", r"(?s)last \d+ trajectories all failed.*injected failure"
                                   r".*--resume", "failure_streak_limit"),
    "stall": (Faults(hang_prob=1.0, hang_seconds=15.0, seed=0),
              {"stall_timeout": 3.0, "env_step_timeout": 1000.0}, "StallError",
              r"(?s)in flight but none has settled.*stall_timeout=3.*--resume",
              "stall_timeout"),
}


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("case", sorted(STOPS))
def test_a_run_that_cannot_progress_stops_with_the_reason(local_cluster, tmp_path, mode,
                                                          case):
    from rollart import recovery

    faults, rollout, error, message, knob = STOPS[case]
    graph = replace(_graph(mode, **rollout),
                    tasks=tuple(with_faults(t, faults) for t in ("gridnav", "boxpush")))
    with pytest.raises(getattr(recovery, error), match=message):
        train(graph, client=local_cluster, run_dir=tmp_path / mode, progress=False,
              eval_seeds=0)
    with pytest.raises(GraphError, match=knob):
        Rollout(**{knob: -1})


class FailsOnEvenSeeds(GridNavEnv):
    """Every member of a group shares its seed: even-seeded groups fail whole."""

    def reset(self, seed):
        if seed % 2 == 0:
            raise RuntimeError(f"broken seed {seed}")
        return super().reset(seed)


def test_sync_mode_refills_groups_whose_every_member_failed(local_cluster, tmp_path):
    """Lockstep members are not replaced; a group with no member left is re-run, so the
    trainer never waits for groups nobody runs."""
    half = replace(get_task("gridnav"), name="halfbroken", env_factory=FailsOnEvenSeeds)
    graph = replace(_graph("sync", failure_streak_limit=0), tasks=(half,),
                    policy=Policy(warmup_steps=0))  # the warm-up would meet even seeds too
    result = train(graph, client=local_cluster, run_dir=tmp_path / "sync", progress=False,
                   eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["rollout/groups_refilled"] > 0
    for r in rows:
        assert sum(r[f"traj/{s}"] for s in STATES) == r["traj/launched"]
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert trained.num_rows == 4 * 3 * 2 and all(s % 2 for s in trained["seed"].to_pylist())


def test_a_comm_error_while_the_trainer_is_alive_reruns_the_step(local_cluster, tmp_path,
                                                                   monkeypatch):
    """A trainer step that fails with a comm error (as when another worker dies while the
    batch is gathered) while the trainer itself is alive is re-run on the same trainer:
    no replacement, no step lost."""
    from rollart.trainer.trainer import Trainer

    real, calls = Trainer._train_step, []

    async def flaky(self, buffer, step, timeout):
        calls.append(step)
        if step == 2 and calls.count(2) == 1:
            raise OSError("connection to a lost worker closed (injected)")
        return await real(self, buffer, step, timeout)

    monkeypatch.setattr(Trainer, "_train_step", flaky)  # in-process workers share it
    result = train(_graph("async"), client=local_cluster, run_dir=tmp_path / "flaky",
                   progress=False, eval_seeds=0)
    rows = _check_run(result, 1)
    assert calls.count(2) == 2 and [r["version"] for r in rows] == [1, 2, 3, 4]
    assert result.recovery == []  # the trainer was never replaced
