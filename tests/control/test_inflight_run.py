"""``Rollout.max_in_flight="auto"`` end to end on a local tagged cluster: an async run
whose env steps are slow enough that the trainer waits for its batches trains; every
row reports the in-flight limit the buffer's slots held during the step (read from the
buffer, not from the driver's controller), within one to ``alpha + 1`` steps' worth of
groups, raised above one step's worth while the trainer starved; the groups holding
slots never exceed it; the trainer takes groups in start order (the take window
"auto" implies)."""

from collections import defaultdict

import pyarrow.compute as pc

from rollart.buffer import read_samples
from rollart.chaos.faults import Faults, Latency, with_faults
from rollart.policy.admission import group_number
from rollart.testing import check_run_record, tiny_graph

GROUPS, ALPHA, STEPS = 3, 1, 6


def test_an_async_run_with_an_adaptive_in_flight_limit_trains(local_cluster, tmp_path):
    from rollart import train

    # 50 ms a turn: a group takes longer than a trainer step here (~0.3 s), so the
    # trainer waits for its batch while the engines batch a row or two of 64
    slow = with_faults("gridnav", Faults(step=Latency("fixed", 0.05)))
    graph = tiny_graph("auto", (slow,), steps=STEPS, groups=GROUPS, alpha=ALPHA,
                       max_in_flight="auto")
    result = train(graph, client=local_cluster, run_dir=tmp_path / "auto",
                   progress=False, eval_seeds=0)
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    check_run_record(result)  # the ledger against the trainer's reports and the rows
    limits = [r["rollout/inflight_limit"] for r in rows]
    assert all(GROUPS <= n <= (ALPHA + 1) * GROUPS for n in limits), limits
    assert max(limits) > GROUPS, (limits, [r["trainer/wait_s"] for r in rows])
    for r, before in zip(rows, [limits[0]] + limits):
        # a shrink stops no running group: those started under the step before's limit
        assert r["rollout/groups_held"] <= max(r["rollout/inflight_limit"], before), r
        assert r["trainer/staleness_max"] <= ALPHA, r
    trained = read_samples(result.run_dir)
    trained = trained.filter(pc.equal(trained["state"], "trained"))
    assert trained.num_rows == STEPS * GROUPS * 2
    by_step = defaultdict(set)
    for gid, step in zip(trained["group_id"].to_pylist(),
                         trained["trained_step"].to_pylist()):
        by_step[step].add(group_number(gid))
    batches = [sorted(by_step[s]) for s in sorted(by_step)]
    # start order: every group a step trained started before any the next step trained
    assert all(a[-1] < b[0] for a, b in zip(batches, batches[1:])), batches
