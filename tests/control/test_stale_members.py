"""``Rollout.stale_members="rescore"`` end to end, briefly, on a local tagged cluster:
the run trains, its rows add up, no trained token is older than the bound, and every
step reports the tokens generated, wasted and re-scored (``rollart.observe.figures``)."""

from dataclasses import replace

import pyarrow.compute as pc
import pytest

from rollart import train
from rollart.buffer import read_samples
from rollart.chaos.faults import Faults, with_faults
from rollart.config.graph import GraphError, Policy, Rollout
from rollart.env.tasks import get_task
from rollart.testing import check_run_record, tiny_graph


def test_an_async_run_with_rescored_stale_members_trains(local_cluster, tmp_path):
    # slow env steps and three steps' worth of groups in flight: groups wait their turn
    # while the trainer moves on, so members cross the bound (alpha 1) mid-episode
    task = with_faults(get_task("gridnav"), Faults(step=0.2))
    graph = tiny_graph("q-rescore", (task,), mode="async", steps=3, groups=3,
                       stale_members="rescore", max_in_flight=3)
    result = train(graph, client=local_cluster, run_dir=tmp_path / "rescore",
                   progress=False, eval_seeds=0)
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    for r in result.metrics:
        assert r["rollout/aborted_now"] == 0  # none aborted at the broadcast
        assert 0 < r["rollout/generated_tokens"] == r["rollout/tokens_generated"]
        assert 0 <= r["rollout/wasted_tokens"] <= r["rollout/generated_tokens"]
        assert r["rollout/wasted_share"] == pytest.approx(
            r["rollout/wasted_tokens"] / r["rollout/generated_tokens"])
        assert r["rollout/rescored_tokens"] >= 0
    last = result.metrics[-1]
    assert last["rollout/rescored_tokens"] > 0 and last["traj/aborted"] == 0
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert trained.num_rows == 3 * 3 * 2
    # the engines generated the trained tokens (the rows written) and the wasted ones,
    # apart: counted twice, or a trained token counted wasted, and this fails
    trained_tokens = sum(sum(m) for m in trained["loss_mask"].to_pylist())
    assert trained_tokens + last["rollout/wasted_tokens"] <= last["rollout/generated_tokens"]
    for versions, mask, step in zip(trained["versions"].to_pylist(),
                                    trained["loss_mask"].to_pylist(),
                                    trained["trained_step"].to_pylist()):
        gen = [v for v, m in zip(versions, mask) if m]
        assert min(gen) >= step - 2, (gen, step)  # trainer at step - 1, alpha 1


def test_stale_members_is_checked_where_it_is_set():
    with pytest.raises(GraphError, match="stale_members must be one of"):
        Rollout(stale_members="keep")
    graph = tiny_graph("t", stale_members="rescore")
    with pytest.raises(GraphError, match="stale_members='abort' or Policy.engine='torch'"):
        replace(graph, policy=Policy(engine="vllm"))
    for mode in ("areal", "sync+", "sync", "one-off"):  # never silently without effect
        with pytest.raises(GraphError, match="applies to mode='async' only"):
            replace(graph, mode=mode)
    # unset, the graph decides: "rescore" in async on the torch engine (decided by
    # measurement: benchmarks/inflight_learning.py and pipeline.py), else "abort"
    assert Rollout().stale_members is None
    assert tiny_graph("t").stale_members == "rescore"
    assert replace(tiny_graph("t"), mode="areal").stale_members == "abort"


@pytest.mark.parametrize("kept", ["rescore", "clip"])
def test_an_async_run_keeping_stale_groups_trains_them(local_cluster, tmp_path, kept):
    """``GRPO.stale_groups="rescore"``: a complete group that went too stale waiting for
    its take is trained, not dropped, and the trainer re-scores exactly its tokens older
    than the bound (counted per step; the written rows show which they were).
    ``"clip"``: the same groups are trained, their tokens as they are (none re-scored),
    so the batch's staleness exceeds the bound, as areal's may."""
    task = with_faults(get_task("gridnav"), Faults(step=0.2))
    graph = tiny_graph("q-keep", (task,), mode="async", steps=4, groups=3,
                       max_in_flight=3, stale_members="abort")
    graph = replace(graph, algo=replace(graph.algo, stale_groups=kept))
    result = train(graph, client=local_cluster, run_dir=tmp_path / "keep",
                   progress=False, eval_seeds=0)
    assert [r["step"] for r in result.metrics] == [1, 2, 3, 4]
    check_run_record(result)
    samples = read_samples(result.run_dir)
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    assert trained.num_rows == 4 * 3 * 2
    assert all(r["trainer/loss"] == r["trainer/loss"] for r in result.metrics)  # no NaN
    # the trainer at step s holds version s - 1: its bound is s - 2
    stale = {}
    for versions, mask, step in zip(trained["versions"].to_pylist(),
                                    trained["loss_mask"].to_pylist(),
                                    trained["trained_step"].to_pylist()):
        stale[step] = stale.get(step, 0) + sum(m and v < step - 2
                                               for v, m in zip(versions, mask))
    by_step = {r["step"]: r["trainer/rescored_tokens"] for r in result.metrics}
    assert sum(stale.values()) > 0  # three steps' worth started at v0: some waited
    if kept == "rescore":
        assert by_step == {s: stale.get(s, 0) for s in by_step}
    else:
        assert set(by_step.values()) == {0}
        assert max(r["trainer/staleness_max"] for r in result.metrics) > 1  # alpha 1
