"""The buffer's share of ``rollout/wasted_tokens``: the generated tokens of every row that
leaves it never trained (dropped stale or late, failed), checked against the rows it
wrote to Parquet."""

import asyncio
import uuid

import pyarrow as pa
import pyarrow.compute as pc

from rollart.buffer import SampleBuffer, read_samples
from rollart.testing import trajectory


def test_the_buffer_counts_the_generated_tokens_of_rows_never_trained():
    run = f"memory://wasted-{uuid.uuid4().hex}"

    def member(gid, i, version, n, **fields):
        mask = [1, 0] * n  # n generated tokens, each followed by an env token
        return trajectory(f"{gid}-{i}", group_id=gid, response=list(range(5, 5 + 2 * n)),
                          mask=mask, version=version, **fields)

    async def scenario():
        buf = SampleBuffer(run, flush_every=1)
        for i in range(2):
            await buf.put(member("fresh", i, 2, 3), 2)
        await buf.put(member("old", 0, 0, 4), 2)  # an open group, then too stale
        await buf.put(member("bad", 0, 2, 5, state="failed", outcome="failed",
                             error="env crashed"), 2)
        assert (await buf.stats())["wasted_tokens"] == 5  # the failed member's
        assert await buf.abort_older_than(1) == 1
        await buf.put(member("old", 1, 0, 6), 2)  # a late member of the dropped group
        got = await buf.get_batch(1, min_version=1, timeout=1)
        assert sorted(t.traj_id for t in got) == ["fresh-0", "fresh-1"]
        wasted = (await buf.stats())["wasted_tokens"]
        await buf.flush()
        await buf.close()
        return wasted

    wasted = asyncio.run(scenario())
    assert wasted == 5 + 4 + 6
    rows = read_samples(run)
    gone = rows.filter(pc.is_in(rows["state"], value_set=pa.array(["dropped", "failed"])))
    assert sum(sum(m) for m in gone["loss_mask"].to_pylist()) == wasted
    trained = rows.filter(pc.equal(rows["state"], "trained"))
    assert sum(sum(m) for m in trained["loss_mask"].to_pylist()) == 6
