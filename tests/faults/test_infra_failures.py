"""Members lost to infrastructure are kept out of GRPO's advantages, on a real in-process
tagged cluster: a member whose env crashes is re-run (replaced) up to its group's bound,
else dropped from its group; a group left smaller than ``GRPO.min_group_size`` is not
trained; each case is counted per task, in the buffer's stats, the step rows
(metrics.jsonl) and ``rollart status``. A trajectory the env scored, reward 0 or not,
is the policy's and trains (``rollart.buffer.infra``)."""

import json
from dataclasses import replace

import pyarrow.compute as pc
import pytest

from rollart import train
from rollart.buffer import SampleBuffer, read_samples
from rollart.buffer.infra import INFRA_COUNTS
from rollart.chaos.faults import Faults, with_faults
from rollart.config.graph import GRPO, GraphError
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.tasks import Task
from rollart.observe.dashboard.status import format_status
from rollart.observe.metrics import fold
from rollart.policy.admission import GroupSequence
from rollart.reward import success_reward
from rollart.testing import check_run_record, tiny_graph
from rollart.types import H20, H800, Trajectory


class CrashEveryOther(GridNavEnv):
    """Odd-numbered instances (1st, 3rd, ...) crash on their first step: a sandbox that
    went away. The count is this process's (the cluster runs in-process): a test sets
    ``made`` to choose which member of the next group crashes."""

    made = 0

    def __init__(self):
        super().__init__()
        CrashEveryOther.made += 1
        self.bad = CrashEveryOther.made % 2 == 1

    def step(self, action):
        if self.bad:
            raise ConnectionError("sandbox went away")
        return super().step(action)


TASK = Task(name="crashy", env_factory=CrashEveryOther, reward_fn=success_reward,
            max_turns=2)


@pytest.fixture(scope="module")
def rollout(local_cluster, tiny_model, tmp_path_factory, rollout_actors):
    where = tmp_path_factory.mktemp("infra")
    mgr, buf, _ = rollout_actors(local_cluster, tiny_model, where / "weights", "infra",
                                 pools=(H800, H20), buffer_dir=where / "buffer")
    return mgr, buf, where / "buffer"


def test_crashed_members_are_rerun_or_dropped_and_never_trained(rollout):
    mgr, buf, buffer_dir = rollout
    # free-running group of 4: each crashed member is replaced (4 re-runs at most), so
    # instances 1, 3, 5, 7 crash and 2, 4, 6, 8 fill it
    CrashEveryOther.made = 0
    out = mgr.run_group(TASK, 1, "rerun", 4).result(timeout=120)
    assert "failed" not in out["outcomes"]
    # lockstep batches re-run nothing: a group of 2 whose 1st instance crashes keeps one
    # member, fewer than GRPO.min_group_size (2): not trained
    CrashEveryOther.made = 0
    mgr.run_batch([(TASK, 2, "small", 2)]).result(timeout=120)
    # a group of 3 whose 2nd instance crashes keeps two members: trained without it
    CrashEveryOther.made = 1
    mgr.run_batch([(TASK, 3, "kept", 3)]).result(timeout=120)

    stats = buf.stats().result()
    assert stats["groups_complete"] == 2  # "small" is not among them
    assert stats["infra"]["crashy"] == {"infra_failed": 4 + 1 + 1, "infra_rerun": 4,
                                        "infra_dropped": 1 + 1, "groups_too_small": 1}
    assert mgr.stats().result()["replaced"] == 4
    table = buf.get_table(2, min_version=0, timeout=10, trained_step=1).result()
    assert sorted(set(table.column("group_id").to_pylist())) == ["kept", "rerun"]
    assert buf.mark_trained(1).result() == 4 + 2

    buf.flush().result()
    rows = read_samples(str(buffer_dir)).to_pylist()
    failed = {r["traj_id"] for r in rows if r["state"] == "failed"}
    assert len(failed) == 6 and all("sandbox went away" in r["error"]
                                    for r in rows if r["state"] == "failed")
    trained = [r for r in rows if r["state"] == "trained"]
    # every trained row is a finished trajectory the env scored, never a crashed one
    assert len(trained) == 6 and not failed & {r["traj_id"] for r in trained}
    assert all(r["outcome"] in ("success", "failure", "truncated") and not r["error"]
               for r in trained)
    # the too-small group's one finished member left as dropped, untrained
    assert [r["state"] for r in rows if r["group_id"] == "small" and r["traj_id"]
            not in failed] == ["dropped"]


def test_a_scored_failure_trains_and_a_crash_does_not():
    """The rule itself, on the buffer alone: an env-scored failure with reward 0 is the
    policy's (it trains); a ``failed`` member is infrastructure's (it is dropped, and
    its group, left with one member, is too small)."""
    import asyncio

    def member(gid, i, **kw):
        return Trajectory(f"{gid}-{i}", "calc", gid, 0, [1], [2], [1], [0.0], [0],
                          reward=kw.pop("reward", 0.0), **kw)

    async def go():
        buf = SampleBuffer(min_group=2)
        await buf.put_many([(member("a", 0, outcome="failure"), 2),
                            (member("a", 1, reward=1.0, outcome="success"), 2),
                            (member("b", 0, outcome="failure"), 2),
                            (member("b", 1, outcome="failed", error="EnvError: gone"), 2)])
        stats = await buf.stats()
        table = await buf.get_table(1, 0, timeout=1)
        with pytest.raises(TimeoutError):  # "b" is not trainable
            await buf.get_table(1, 0, timeout=0.1)
        return stats, table

    stats, table = asyncio.run(go())
    assert table.column("traj_id").to_pylist() == ["a-0", "a-1"]
    assert table.column("reward").to_pylist() == [0.0, 1.0]
    assert stats["infra"]["calc"] == {"infra_failed": 1, "infra_rerun": 0,
                                      "infra_dropped": 1, "groups_too_small": 1}
    assert (stats["failed"], stats["dropped"], stats["buffered"]) == (1, 1, 2)
    with pytest.raises(GraphError, match="min_group_size must be ≤ group_size"):
        GRPO(group_size=2, min_group_size=3)


def test_the_counts_survive_the_buffers_recovery(tmp_path):
    """A buffer re-created from the lost one's journal (``recover=True``) continues the
    counts instead of starting them again at 0."""
    import asyncio

    crashed = Trajectory("g-1", "calc", "g", 0, [1], [2], [1], [0.0], [0], outcome="failed",
                         error="ConnectionError: sandbox went away")
    kept = Trajectory("g-0", "calc", "g", 0, [1], [2], [1], [0.0], [0], outcome="failure")

    async def go():
        buf = SampleBuffer(str(tmp_path))
        await buf.put_many([(kept, 2), (crashed, 2)])
        await buf.flush()
        before = (await buf.stats())["infra"]
        await buf.close()
        again = SampleBuffer(str(tmp_path), recover=True)
        after = (await again.stats())["infra"]
        await again.close()
        return before, after

    before, after = asyncio.run(go())
    assert before == after == {"calc": {"infra_failed": 1, "infra_rerun": 0,
                                        "infra_dropped": 1, "groups_too_small": 1}}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_run_counts_lost_members_in_its_rows_and_status(local_cluster, tmp_path, mode):
    """A run whose first group's env crashes on every member (a fault planted for its
    episode seed): its members are re-run (not in ``sync``'s lockstep), then dropped, the
    group is not trained (``sync`` rolls out another in its place), and the rows
    (metrics.jsonl) and ``rollart status`` count them."""
    graph = tiny_graph(f"infra-{mode}", mode=mode, steps=2, groups=2)
    seq = GroupSequence(("gridnav",), None, graph.seed, graph.algo.group_size)
    first = seq.next()[1]
    graph = replace(graph, tasks=(with_faults("gridnav", Faults(fail_seeds=(first,))),))
    run_dir = tmp_path / f"infra-{mode}"  # its name is the run's in the events
    result = train(graph, client=local_cluster, run_dir=run_dir, progress=False,
                   eval_seeds=0)
    check_run_record(result)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    # async: 2 members, each re-run once (a group of 2 re-runs 2), then 2 dropped; sync:
    # 2 dropped at once. Each is counted for its task and in all
    reruns = 2 if mode == "async" else 0
    assert last["task/infra_failed/gridnav"] == last["rollout/infra_failed"] >= 2 + reruns
    assert last["rollout/infra_rerun"] >= reruns and last["rollout/infra_dropped"] >= 2
    if mode == "sync":
        assert last["rollout/infra_rerun"] == 0 and last["rollout/groups_refilled"] >= 1
    assert last["rollout/groups_too_small"] == last["task/groups_too_small/gridnav"] >= 1
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert first not in trained["seed"].to_pylist()
    assert "failed" not in trained["outcome"].to_pylist()
    assert trained.num_rows == 2 * 2 * 2
    # the rows the scheduler's events carry (what `rollart status` folds)
    runs = fold(local_cluster.get_events("rollart"))
    name = run_dir.name
    summary = runs[name].summary()
    assert summary["infra"] == {k: last[f"rollout/{k}"] for k in INFRA_COUNTS
                                if last[f"rollout/{k}"]}  # the counts not 0
    assert f"  infra:        infra_failed={last['rollout/infra_failed']}" in format_status(
        {name: summary})
