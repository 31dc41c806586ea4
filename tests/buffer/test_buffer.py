"""Tests for rollart.buffer: the Arrow schema, Parquet I/O and the SampleBuffer actor."""

from __future__ import annotations

import asyncio
import time
import uuid

import fsspec
import pyarrow as pa
import pytest

from rollart.buffer import SCHEMA, SampleBuffer, from_table, read_samples, to_record_batch
from rollart.buffer import schema as schema_mod
from rollart.buffer import write_parquet
from rollart.buffer.schema import batch_digest
from rollart.testing import cluster_fixture
from rollart.types import CPU_ENV, Trajectory

distributed = pytest.importorskip("distributed")


def make(gid: str, i: int, version: int, *, failed: bool = False, outcome: str = "success"):
    """A small trajectory; every float is exactly representable in float32."""
    return Trajectory(
        traj_id=f"{gid}-{i}",
        task="countdown",
        group_id=gid,
        seed=1234567890123 + i,
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13],
        loss_mask=[1, 1, 0, 1],
        logprobs=[-0.5, -1.25, 0.0, -2.0],
        versions=[version, version + 1, -1, version],
        reward=0.1 * i,
        num_turns=2,
        env_time=0.125,
        gen_time=1.5,
        outcome="failed" if failed else outcome,
        error="boom" if failed else "",
        state="failed" if failed else "scoring",
    )


def check_every_put_accounted(c: dict, n_put: int) -> None:
    """Against the test's own record: each of the ``n_put`` trajectories it put was
    received once and is held or has left."""
    held = c["buffered"] + c["taken"]
    left = c["trained"] + c["dropped"] + c["failed"] + c["lost_in_step"]
    assert c["received"] == n_put == held + left, c


# -- schema ------------------------------------------------------------------------------
def test_schema_round_trip():
    trajs = [make("g", 0, 3), make("g", 1, 0, failed=True)]
    empty = Trajectory("e", "t", "g2", -1, [], [], [], [], [], reward=-1.0, state="trained")
    trajs.append(empty)
    batch = to_record_batch(trajs, trained_step=5)
    assert batch.schema.equals(SCHEMA, check_metadata=True)
    assert batch.column("version").to_pylist() == [3, 0, -1]
    assert batch.column("trained_step").to_pylist() == [5, 5, 5]
    assert from_table(batch) == trajs
    assert from_table(pa.Table.from_batches([batch, batch])) == trajs + trajs
    assert to_record_batch([], None).num_rows == 0
    assert to_record_batch(trajs[:1]).column("trained_step").to_pylist() == [None]


def test_schema_docs_and_metadata():
    assert SCHEMA.metadata[b"rollart_schema_version"] == b"2"
    for f in SCHEMA:
        assert f.metadata and f.metadata[b"doc"].strip(), f.name
        assert f.name in schema_mod.__doc__
    assert SCHEMA.field("reward").type == pa.float64()
    assert SCHEMA.field("trained_step").nullable


@pytest.mark.parametrize("where", ["memory", "local"])
def test_parquet_round_trip(where, tmp_path):
    run = f"memory://rt-{uuid.uuid4().hex}" if where == "memory" else str(tmp_path / "run")
    a = [make("a", i, 1) for i in range(3)]
    b = [make("b", 0, 2, failed=True)]
    write_parquet([to_record_batch(a, 4)], f"{run}/samples/part-00000.parquet")
    write_parquet(to_record_batch(b), f"{run}/samples/part-00001.parquet")
    table = read_samples(run)
    assert table.schema.equals(SCHEMA, check_metadata=True)
    assert from_table(table) == a + b
    assert table.column("trained_step").to_pylist() == [4, 4, 4, None]
    assert read_samples(f"{run}/samples").num_rows == 4
    assert read_samples(f"{run}/samples/part-00001.parquet").num_rows == 1
    assert read_samples(f"{run}/nothing-here").num_rows == 0


# -- buffer logic without Dask (fast) ----------------------------------------------------
def test_buffer_in_process_memory_url():
    run = f"memory://buf-{uuid.uuid4().hex}"

    async def scenario():
        buf = SampleBuffer(run, flush_every=3)
        for i in range(4):
            await buf.put(make("x", i, 2), 4)
        for i in range(2):  # incomplete, old
            await buf.put(make("y", i, 0), 4)
        st = await buf.stats()
        assert st["buffered_rows"] == 6 and st["arrow_bytes"] > 0
        assert st["groups_complete"] == 1 and st["groups_incomplete"] == 1
        assert await buf.abort_older_than(1) == 2
        await buf.put(make("y", 2, 0), 4)  # late member of an aborted group
        got = await buf.get_batch(1, 1, timeout=1, trained_step=0)
        assert [t.traj_id for t in got] == [f"x-{i}" for i in range(4)]
        assert (await buf.counts())["taken"] == 4
        assert await buf.mark_trained(0) == 4
        c = await buf.counts()
        check_every_put_accounted(c, 4 + 2 + 1)  # x, y, the late member of y
        assert c["dropped"] == 3 and c["trained"] == 4 and await buf.size() == 0
        assert (await buf.stats())["arrow_bytes"] == 0
        await buf.close()

    asyncio.run(scenario())
    table = read_samples(run)
    assert sorted(table.column("state").to_pylist()) == ["dropped"] * 3 + ["trained"] * 4
    assert len(fsspec.filesystem("memory").glob(f"{run[9:]}/samples/*.parquet")) >= 2


def test_no_launch_after_the_run_ended():
    """The end of a run (``orphan_all_in_flight``) fails what is still in flight and
    takes no new launch: one from an env manager left running on a lost worker's
    remains would otherwise stay in flight in the final counts (seen once under the
    full suite's load in tests/faults/test_modes_recovery.py[areal])."""

    async def scenario():
        buf = SampleBuffer(None)
        await buf.launched(["a-0", "a-1"])
        await buf.put(make("a", 0, 0), 2)
        assert await buf.orphan_all_in_flight() == 1  # a-1
        with pytest.raises(RuntimeError, match="the run has ended"):
            await buf.launched(["b-0"])
        c = await buf.counts()
        assert (c["launched"], c["in_flight"], c["failed"], c["orphaned"]) == (2, 0, 1, 1)
        await buf.close()

    asyncio.run(scenario())


def test_put_many_books_each_item_as_put_does_past_a_bad_one(tmp_path):
    """One ``put_many`` call (how env managers deliver): every good item is booked, the
    bad one's error is returned in its place, and the group the call completed is
    durable when it returns (a buffer recovered from the run directory has it)."""
    run = str(tmp_path / "run")

    async def first():
        buf = SampleBuffer(run)
        await buf.launched(["a-0", "a-1", "b-0", "b-1"])
        errors = await buf.put_many([(make("a", 0, 0), 2), ("not a trajectory", 2),
                                     (make("a", 1, 0), 2), (make("b", 0, 0), 2)])
        assert [e is None for e in errors] == [True, False, True, True]
        assert isinstance(errors[1], AttributeError)
        with pytest.raises(AttributeError):  # put raises its one item's error
            await buf.put("not a trajectory", 2)
        c = await buf.counts()
        assert (c["received"], c["buffered"], c["in_flight"]) == (3, 3, 1), c
        # no store.drain(): put_many returned, so the completed group is durable already

    async def second():
        buf = SampleBuffer(run, recover=True)
        table = await buf.get_table(1, min_version=-1, timeout=5)
        assert sorted(table.column("traj_id").to_pylist()) == ["a-0", "a-1"]
        await buf.close()

    asyncio.run(first())
    asyncio.run(second())


def test_taken_until_confirmed_release_and_stale_confirmations():
    from rollart.buffer.buffer import TAKE_KEY

    async def scenario():
        buf = SampleBuffer(None)
        for g in "abc":
            for i in range(2):
                await buf.put(make(g, i, 3), 2)
        first = await buf.get_table(1, 2, trained_step=1)
        assert first.column("traj_id").to_pylist() == ["a-0", "a-1"]
        c = await buf.counts()
        assert (c["taken"], c["trained"], c["buffered"]) == (2, 0, 4)
        # the trainer was lost and its replacement holds the same version: back in line
        assert await buf.release_taken(1, 2) == {"trained": 0, "buffered": 2}
        assert await buf.release_taken(1, 2) == {"trained": 0, "buffered": 0}
        again = await buf.get_table(2, 2, trained_step=1)  # the re-run takes a first
        assert again.column("traj_id").to_pylist() == ["a-0", "a-1", "b-0", "b-1"]
        # the lost trainer's late confirmation names the first hand-out: refused
        assert await buf.mark_trained(1, first.schema.metadata[TAKE_KEY].decode()) == 0
        assert (await buf.counts())["taken"] == 4
        assert await buf.mark_trained(1, again.schema.metadata[TAKE_KEY].decode()) == 4
        assert await buf.mark_trained(1) == 0  # nothing taken for step 1 any more
        # published before the trainer died: its replacement is one version on
        late = await buf.get_table(1, 2, trained_step=2)
        # the step stands: its batch's digest and the trainer's figures for it (its
        # update was computed on v4, the rows are v3)
        settled = await buf.release_taken(2, 3, 4)
        ids, rewards = late.column("traj_id").to_pylist(), late.column("reward").to_pylist()
        figures = settled.pop("metrics")
        assert settled == {"trained": 2, "buffered": 0, "batch_sha1": batch_digest(ids)}
        task = late.column("task")[0].as_py()
        assert figures[f"reward/{task}"] == pytest.approx(sum(rewards) / 2)
        assert (figures["trainer/batch_size"], figures["trainer/batch_sha1"],
                figures["trainer/staleness_max"]) == (2, batch_digest(ids), 1)
        c = await buf.counts()
        check_every_put_accounted(c, 3 * 2)
        assert (c["taken"], c["trained"], c["buffered"]) == (0, 6, 0)

    asyncio.run(scenario())


def test_next_get_table_settles_a_batch_left_taken():
    """No confirmation and no release came (the buffer was replaced, a call was lost):
    the next take settles it by the asking trainer's version."""

    async def scenario():
        buf = SampleBuffer(None)
        for g in "abcd":
            for i in range(2):
                await buf.put(make(g, i, 3), 2)
        await buf.get_table(1, 2, trained_step=1)
        got = await buf.get_table(1, 2, trained_step=1)  # the same version: a re-run
        assert got.column("group_id").to_pylist() == ["a", "a"]
        got = await buf.get_table(1, 3, trained_step=2)  # one version on: 1 published
        assert got.column("group_id").to_pylist() == ["b", "b"]
        c = await buf.counts()
        assert (c["trained"], c["taken"], c["buffered"]) == (2, 2, 4)
        assert (buf.ledger.state["a-1"], buf.ledger.state["b-1"]) == ("trained", "taken")

    asyncio.run(scenario())


# -- the actor on a real in-process Dask cluster -----------------------------------------
client = cluster_fixture(CPU_ENV)


def actor(client, run_dir, **kw):
    fut = client.submit(SampleBuffer, run_dir, actor=True, resources={CPU_ENV: 1}, **kw)
    return fut.result()


def put_all(buf, trajs, group_size=4):
    for t in trajs:  # one at a time: arrival order matters for FIFO
        buf.put(t, group_size).result()


def test_actor_fifo_stale_and_parquet(client, tmp_path):
    buf = actor(client, str(tmp_path), key=f"buf-{uuid.uuid4().hex}")
    old = [make("old", i, 4) for i in range(3)] + [make("old", 3, 0)]  # group version 0
    a = [make("a", i, 2) for i in range(4)]
    b = [make("b", i, 3) for i in range(4)]
    # b starts first but completes last; the stale group completes in between
    put_all(buf, b[:3] + a + old + b[3:])
    assert buf.counts().result()["groups_complete"] == 3
    got = buf.get_batch(2, min_version=1, timeout=5, trained_step=7).result()
    assert [t.group_id for t in got] == ["a"] * 4 + ["b"] * 4
    assert {t.state for t in got} == {"taken"}
    assert buf.mark_trained(7).result() == 8
    assert [t.traj_id for t in got[:4]] == [t.traj_id for t in a]
    assert got[0].logprobs == a[0].logprobs and got[0].reward == a[0].reward
    c = buf.counts().result()
    assert (c["trained"], c["dropped"], c["buffered"], c["received"]) == (8, 4, 0, 12)
    check_every_put_accounted(c, len(old + a + b))
    buf.close().result()
    files = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert files == ["part-00000.parquet"]
    table = read_samples(str(tmp_path))
    rows = dict(zip(table.column("traj_id").to_pylist(), table.column("state").to_pylist()))
    assert len(rows) == 12 and all(rows[t.traj_id] == "dropped" for t in old)
    steps = {s for s, st in zip(table.column("trained_step").to_pylist(),
                                table.column("state").to_pylist()) if st == "trained"}
    assert steps == {7}


def test_actor_get_table_sends_one_arrow_table(client):
    """The Trainer's pull: the same groups as ``get_batch``, as one Arrow table in
    ``SCHEMA`` (a group's members became Arrow once, when it completed)."""
    buf = actor(client, None, key=f"buf-{uuid.uuid4().hex}")
    trajs = [make("t", i, 2) for i in range(4)] + [make("u", i, 2) for i in range(3)]
    put_all(buf, trajs)
    assert buf.stats().result()["arrow_bytes"] > 0  # the open group "u" counted too
    table = buf.get_table(1, min_version=0, timeout=5, trained_step=3).result()
    assert isinstance(table, pa.Table) and table.schema.equals(SCHEMA)
    got = from_table(table)
    assert [t.traj_id for t in got] == [t.traj_id for t in trajs[:4]]
    assert got[2].response_ids == trajs[2].response_ids and {t.state for t in got} == {"taken"}
    assert table.column("trained_step").to_pylist() == [3] * 4
    assert buf.get_table(0, min_version=0).result().num_rows == 0
    check_every_put_accounted(buf.counts().result(), len(trajs))


def test_actor_waiting_get_batch_is_woken_by_put(client):
    buf = actor(client, None, key=f"buf-{uuid.uuid4().hex}")
    fut = buf.get_batch(1, min_version=0, timeout=20)
    deadline = time.monotonic() + 10
    while buf.stats().result()["waiters"] != 1:
        assert time.monotonic() < deadline, "get_batch never started waiting"
        time.sleep(0.02)
    put_all(buf, [make("w", i, 1) for i in range(3)])
    assert buf.stats().result()["waiters"] == 1  # incomplete group: still waiting
    put_all(buf, [make("w", 3, 1)])
    got = fut.result(timeout=10)
    assert [t.traj_id for t in got] == [f"w-{i}" for i in range(4)]
    check_every_put_accounted(buf.counts().result(), 4)


def test_actor_timeout_and_failed_members(client, tmp_path):
    buf = actor(client, str(tmp_path), flush_every=2, key=f"buf-{uuid.uuid4().hex}")
    with pytest.raises(TimeoutError, match="complete groups"):
        buf.get_batch(1, min_version=0, timeout=0.2).result(timeout=10)
    # all members failed: complete, but never counts toward n_groups
    put_all(buf, [make("dead", i, 1, failed=True) for i in range(4)])
    with pytest.raises(TimeoutError):
        buf.get_batch(1, min_version=0, timeout=0.2).result(timeout=10)
    # two failed members (by state, by outcome) still count toward completion
    mixed = [make("m", 0, 1), make("m", 1, 1, failed=True), make("m", 2, 1)]
    mixed.append(make("m", 3, 1, outcome="failed"))
    put_all(buf, mixed)
    got = buf.get_batch(1, min_version=0, timeout=5, trained_step=1).result()
    assert [t.traj_id for t in got] == ["m-0", "m-2"]
    buf.mark_trained(1).result()
    c = buf.counts().result()
    assert (c["failed"], c["trained"], c["received"]) == (6, 2, 8)
    check_every_put_accounted(c, 4 + len(mixed))
    buf.flush().result()
    table = read_samples(str(tmp_path))
    assert sorted(table.column("state").to_pylist()) == ["failed"] * 6 + ["trained"] * 2
    assert len(list((tmp_path / "samples").glob("part-*.parquet"))) >= 2


def test_arrivals_and_settlements_never_launched_are_counted_unannounced():
    """A buffer fed without env managers takes what arrives, and says how much of it it
    never saw launched (``counts()["unannounced"]``, ``Ledger.adopt``)."""
    async def main():
        buf = SampleBuffer(None)
        await buf.launched(["g-0"])
        await buf.put(make("g", 0, 0), 2)
        await buf.put(make("g", 1, 0), 2)
        await buf.settle(["h-0"], "cancelled")
        counts = await buf.counts()
        await buf.close()
        return counts

    c = asyncio.run(main())
    assert (c["launched"], c["unannounced"], c["buffered"], c["cancelled"]) == (3, 2, 2, 1), c
