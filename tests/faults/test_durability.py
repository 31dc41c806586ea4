"""The data of record is durable (rollart.buffer.journal) and ``trained`` means trained.

* a complete group is in the run dir when ``put`` returns, before any part is written;
* ``SampleBuffer(run_dir, recover=True)`` after the buffer's worker was closed abruptly
  on a real in-process cluster: counts and batches checked against the ids the test
  itself launched, not against the ledger's own bookkeeping;
* the trainer's worker killed mid-step (``Pipeline.train`` with a real ``Supervisor``):
  no trajectory is ``trained`` in Parquet unless an update with it was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from collections import Counter

import pytest

from rollart.buffer import SampleBuffer, journal, read_parts, read_samples
from rollart.buffer.ledger import STATES
from rollart.types import CPU_ENV, Trajectory

distributed = pytest.importorskip("distributed")


def make(gid: str, i: int, version: int, *, failed: bool = False) -> Trajectory:
    return Trajectory(traj_id=f"{gid}-{i}", task="countdown", group_id=gid, seed=7,
                      prompt_ids=[1, 2, 3], response_ids=[10, 11, 12],
                      loss_mask=[1, 1, 1], logprobs=[-0.5, -1.0, -2.0],
                      versions=[version] * 3, reward=0.25 * i,
                      outcome="failed" if failed else "success", error="boom" if failed else "")


def states(run: str) -> dict[str, tuple[str, int | None]]:
    t = read_samples(run)
    return dict(zip(t.column("traj_id").to_pylist(),
                    zip(t.column("state").to_pylist(), t.column("trained_step").to_pylist())))


@pytest.mark.parametrize("where", ["memory", "local"])
def test_complete_group_is_durable_when_put_returns(where, tmp_path):
    run = f"memory://dur-{uuid.uuid4().hex}" if where == "memory" else str(tmp_path / "run")

    async def scenario():
        buf = SampleBuffer(run, flush_every=1000)  # no part before the end
        await buf.launched([f"a-{i}" for i in range(3)] + [f"b-{i}" for i in range(3)])
        for i in range(3):
            await buf.put(make("a", i, 0), 3)
        await buf.put(make("b", 0, 0), 3)  # an open group: not durable yet
        assert states(run) == {f"a-{i}": ("buffered", None) for i in range(3)}
        got = await buf.get_table(1, 0, trained_step=5)
        assert got.column("state").to_pylist() == ["taken"] * 3
        assert {s for s in states(run).values()} == {("taken", 5)}
        assert await buf.mark_trained(5) == 3
        assert {s for s in states(run).values()} == {("trained", 5)}
        assert read_parts(run).num_rows == 0  # all of it came from the journal
        await buf.close()
        parts = read_parts(run)  # the contract: rows that left, final state
        assert sorted(parts.column("traj_id").to_pylist()) == [f"a-{i}" for i in range(3)]
        assert set(parts.column("state").to_pylist()) == {"trained"}

    asyncio.run(scenario())


def test_close_turns_an_unconfirmed_batch_into_lost_in_step(tmp_path):
    run = str(tmp_path)

    async def scenario():
        buf = SampleBuffer(run)
        for i in range(2):
            await buf.put(make("a", i, 0), 2)
        await buf.get_table(1, 0, trained_step=1)
        await buf.close()
        c = await buf.counts()
        assert (c["taken"], c["lost_in_step"], c["trained"]) == (0, 2, 0)

    asyncio.run(scenario())
    assert set(states(run).values()) == {("lost_in_step", 1)}


@pytest.mark.parametrize("later_checkpoint", [False, True])
def test_checkpoint_restore_keeps_taken_batches_and_sets_the_lost_run_aside(
        later_checkpoint, tmp_path):
    """``snapshot`` with a batch taken, an open group and a member in flight; the old run
    goes on after it (confirms, trains more); a fresh buffer restored from the snapshot
    sees none of that: the taken batch is taken again, the open group dropped, the
    member in flight aborted, and the later journal and parts moved aside.
    ``later_checkpoint``: the lost run checkpointed again (compacting the journal it
    wrote after the first one) before the restore from the first: the same outcome."""
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")

    async def scenario():
        old = SampleBuffer(run, flush_every=2)
        launched = [f"{g}-{i}" for g in "abcd" for i in range(2)]
        await old.launched(launched)
        for t in [make("a", 0, 1), make("a", 1, 1), make("b", 0, 1), make("b", 1, 1),
                  make("c", 0, 1)]:
            await old.put(t, 2)
        await old.get_table(1, 0, trained_step=1)  # a: taken, not confirmed
        await old.snapshot(ckpt)
        await old.mark_trained(1)  # the lost run went on after its checkpoint
        await old.put(make("c", 1, 1), 2)
        await old.get_table(1, 0, trained_step=2)
        await old.mark_trained(2)
        await old.flush()
        if later_checkpoint:
            before = len(journal.entries(run, "ledger"))
            await old.snapshot(str(tmp_path / "ckpt2"))
            assert len(journal.entries(run, "ledger")) < before
        lost_run = states(run)
        assert {t for t, (s, _) in lost_run.items() if s == "trained"} == \
            {"a-0", "a-1", "b-0", "b-1"} and lost_run["c-1"] == ("buffered", None)
        new = SampleBuffer(run, flush_every=2)
        assert await new.restore(ckpt) == 2  # b buffered (a taken, c dropped)
        c = await new.counts()
        assert (c["taken"], c["buffered"], c["dropped"], c["aborted"], c["trained"]) == \
            (2, 2, 1, 3, 0)
        assert c["launched"] == len(launched)
        on_disk = states(run)
        # every id the test launched: on disk, or in flight at the snapshot (aborted)
        assert sorted([*on_disk, "c-1", "d-0", "d-1"]) == sorted(launched)
        assert {t: s for t, s in on_disk.items()} == {
            "a-0": ("taken", 1), "a-1": ("taken", 1), "b-0": ("buffered", None),
            "b-1": ("buffered", None), "c-0": ("dropped", None)}
        # the resumed trainer (the checkpoint's version) re-runs step 1: a first, then b
        got = await new.get_table(1, 0, trained_step=1)
        assert got.column("group_id").to_pylist() == ["a", "a"]
        assert await new.mark_trained(1) == 2
        got = await new.get_table(1, 0, trained_step=2)
        assert got.column("group_id").to_pylist() == ["b", "b"]
        await new.mark_trained(2)
        await new.close()

    asyncio.run(scenario())
    assert {t: s for t, s in states(run).items() if s[0] == "trained"} == {
        "a-0": ("trained", 1), "a-1": ("trained", 1), "b-0": ("trained", 2),
        "b-1": ("trained", 2)}
    assert (tmp_path / "run" / "ledger" / "after-resume-0").is_dir()


# -- compaction: the journal merged at checkpoints replays the same --------------------
def _journal_run(run: str) -> int:
    """A buffer's journal with every kind of entry: launches, complete groups, a failed
    arrival, a batch trained, a batch taken and unconfirmed, an open group, a flush.
    Returns the next entry number."""
    async def scenario():
        buf = SampleBuffer(run, flush_every=3)
        await buf.launched([f"{g}-{i}" for g in "abcdef" for i in range(2)])
        for t in [make("a", 0, 1), make("a", 1, 1), make("b", 0, 1),
                  make("c", 0, 1, failed=True), make("b", 1, 1), make("d", 0, 1)]:
            await buf.put(t, 2)
        await buf.get_table(1, 0, trained_step=1)
        await buf.mark_trained(1)
        await buf.flush()
        for t in [make("c", 1, 1), make("e", 0, 1), make("e", 1, 1), make("d", 1, 1)]:
            await buf.put(t, 2)
        await buf.get_table(1, 0, trained_step=2)  # taken; the buffer is then lost
        await buf.store.drain()
        return buf.journal.next_entry

    return asyncio.run(scenario())


def _recovered(run: str) -> tuple:
    async def scenario():
        buf = SampleBuffer(run, recover=True)
        c = await buf.counts()
        got = await buf.get_table(2, 0, trained_step=3, timeout=5)
        return ({k: c[k] for k in ("launched", *STATES, "orphaned")},
                sorted(got.column("traj_id").to_pylist()))

    return asyncio.run(scenario())


def test_a_compacted_journal_replays_and_recovers_identically(tmp_path):
    """The same journal, compacted in two ranges (``journal.compact``) and not: the same
    rows and states (``read_samples``), and a buffer recovered from either has the same
    counts and hands out the same next batch."""
    import shutil

    import pyarrow.compute as pc

    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    upto = _journal_run(plain)
    shutil.copytree(plain, packed)
    assert len(journal.entries(packed, "ledger")) == upto > 4
    assert journal.compact(packed, upto // 2) > 0  # a first range, then the rest
    assert journal.compact(packed, upto) > 0
    assert journal.compact(packed, upto) == 0  # nothing new since
    assert len(journal.entries(packed, "ledger")) == 2
    assert journal.read_ledger(packed).next_entry == journal.read_ledger(plain).next_entry

    def rows(run):
        t = read_samples(run)
        return t.take(pc.sort_indices(t, [("traj_id", "ascending")])).to_pylist()

    assert rows(packed) == rows(plain) and len(rows(plain)) == 10
    assert journal.read_ledger(packed).orphans == journal.read_ledger(plain).orphans
    assert _recovered(packed) == _recovered(plain)


# -- a real cluster: the buffer's worker closed abruptly -------------------------------
@pytest.fixture()
def two_workers():
    from distributed import Client

    from rollart.runtime.resources import Pool, Resources

    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env", workers=2),),
                    processes=False, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        yield cluster, client


def _buffer_on(client, addr: str, run: str, **kw):
    return client.submit(SampleBuffer, run, actor=True, workers=[addr], flush_every=1000,
                         key=f"buf-{uuid.uuid4().hex}", **kw).result()


def _put(buf, trajs, size=4):
    buf.launched([t.traj_id for t in trajs]).result()
    for t in trajs:
        buf.put(t, size).result()


def test_recover_after_the_buffers_worker_is_lost(two_workers, tmp_path):
    from rollart.control.supervisor import lose_worker
    from rollart.runtime.resources import workers_with

    cluster, client = two_workers
    old_addr, new_addr = workers_with(client, CPU_ENV)
    run = str(tmp_path / "run")
    buf = _buffer_on(client, old_addr, run)
    launched: list[str] = []

    def group(gid, n, version=2, size=4):
        trajs = [make(gid, i, version) for i in range(n)]
        launched.extend(t.traj_id for t in trajs)
        _put(buf, trajs, size)

    group("g", 4)                     # trained at step 0
    assert len(buf.get_table(1, 0, trained_step=0).result()) == 4
    assert buf.mark_trained(0).result() == 4
    group("e", 4)                     # taken by step 1, never confirmed
    assert buf.get_table(1, 0, trained_step=1).result().column("traj_id").to_pylist() == \
        [f"e-{i}" for i in range(4)]
    failed = make("f", 0, 2, failed=True)  # a failed member its manager replaced
    buf.launched([failed.traj_id]).result()
    launched.append(failed.traj_id)
    buf.record_failed(failed).result()
    group("a", 4)                     # complete, buffered
    group("b", 4, version=0)          # complete, buffered, but stale for min_version 1
    group("c", 2)                     # open group: 2 arrived, 2 still running
    running = ["c-2", "c-3", "d-0", "d-1", "d-2", "d-3"]
    buf.launched(running).result()
    launched += running
    assert read_parts(run).num_rows == 0  # flush_every=1000: nothing left in parts yet

    lose_worker(cluster, client, old_addr, restart_after=None)
    new = _buffer_on(client, new_addr, run, recover=True)

    c = new.counts().result()
    assert c["launched"] == len(launched)
    lost = ["c-0", "c-1", *running]   # never durable, or still in flight: orphaned
    # every id the test launched is on disk (read_samples) unless the test lost it
    assert sorted(states(run)) == sorted(set(launched) - set(lost))
    assert (c["trained"], c["taken"], c["buffered"]) == (4, 4, 8)
    assert (c["failed"], c["orphaned"], c["in_flight"]) == (1 + len(lost), len(lost), 0)
    on_disk = states(run)
    assert {t for t, s in on_disk.items() if s == ("trained", 0)} == {f"g-{i}" for i in range(4)}
    assert {t for t, s in on_disk.items() if s == ("taken", 1)} == {f"e-{i}" for i in range(4)}
    assert on_disk["f-0"][0] == "failed"
    # rows that had left (trained g, failed f) are back in the samples/ parts
    assert sorted(read_parts(run).column("traj_id").to_pylist()) == \
        sorted(["f-0"] + [f"g-{i}" for i in range(4)])

    # late arrivals: an orphaned member is ignored; a new member of the closed group
    # is dropped; the taken batch of step 1 comes back first for the re-run of step 1
    new.put(make("d", 0, 2), 4).result()
    new.launched(["c-9"]).result()
    new.put(make("c", 9, 2), 4).result()
    got = new.get_table(2, 0, trained_step=1).result().column("traj_id").to_pylist()
    assert got == [f"e-{i}" for i in range(4)] + [f"a-{i}" for i in range(4)]
    assert new.mark_trained(1).result() == 8
    with pytest.raises(TimeoutError):  # b (version 0) is too stale for min_version 1
        new.get_table(1, 1, timeout=0.2, trained_step=2).result()
    c = new.counts().result()
    assert (c["trained"], c["dropped"], c["ignored"], c["buffered"]) == (12, 4 + 1, 1, 0)
    assert c["launched"] == len(launched) + 1
    # on disk: every id launched but the lost ones, plus the late c-9 (dropped); d-0's
    # late arrival (orphaned) left no row
    assert sorted(states(run)) == sorted((set(launched) | {"c-9"}) - set(lost))
    new.close().result()
    final = Counter(s for s, _ in states(run).values())
    assert final == {"trained": 12, "dropped": 5, "failed": 1}


def test_recover_settles_a_published_batch_as_trained(tmp_path):
    """The trainer published its update but the buffer died before the confirmation: a
    recovered buffer asked by a trainer one version newer marks the batch trained."""
    run = str(tmp_path)

    async def scenario():
        buf = SampleBuffer(run)
        for g in "xy":
            for i in range(2):
                await buf.put(make(g, i, 3), 2)
        await buf.get_table(1, 2, trained_step=4)  # trainer at version 2+alpha
        new = SampleBuffer(run, recover=True)
        assert new.recovered["taken"] == 2
        got = await new.get_table(1, 3, trained_step=5)  # the next step, one version on
        assert got.column("traj_id").to_pylist() == ["y-0", "y-1"]
        c = await new.counts()
        assert (c["trained"], c["taken"], c["buffered"]) == (2, 2, 0)
        await new.mark_trained(5)
        await new.close()

    asyncio.run(scenario())
    assert states(run) == {"x-0": ("trained", 4), "x-1": ("trained", 4),
                           "y-0": ("trained", 5), "y-1": ("trained", 5)}


def test_recover_without_a_journal_is_an_empty_buffer(tmp_path):
    buf = SampleBuffer(str(tmp_path), recover=True)
    assert buf.recovered["entries"] == 0 and asyncio.run(buf.counts())["launched"] == 0
    with pytest.raises(ValueError, match="needs the run_dir"):
        SampleBuffer(None, recover=True)


# -- a real cluster: the trainer's worker killed mid-step ------------------------------
def _long(gid: str, i: int, rng, version: int) -> Trajectory:
    """A long trajectory (100 prompt + 400 response tokens): a step on 16 of them takes
    about a second on the tiny model, so the trainer is killed during its update."""
    resp = [rng.randrange(3, 30) for _ in range(400)]
    return Trajectory(traj_id=f"{gid}-{i}", task="gridnav", group_id=gid, seed=1,
                      prompt_ids=[rng.randrange(3, 30) for _ in range(100)],
                      response_ids=resp, loss_mask=[1] * 400, logprobs=[-3.0] * 400,
                      versions=[version] * 400, reward=float(i % 2), outcome="success")


def _kill_when_taken(cluster, client, buf, addr, log):
    """Kill the trainer's worker as soon as the buffer has a batch taken (mid-step)."""
    from rollart.control.supervisor import lose_worker

    deadline = time.monotonic() + 120
    while buf.counts().result()["taken"] == 0:
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)
    log.append(lose_worker(cluster, client, addr, restart_after=0.5))


def _trained_by_step(run):
    """The ``trained`` rows of ``run`` (an Arrow table) and their ids per trained_step."""
    import pyarrow.compute as pc

    samples = read_samples(str(run))
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    by_step: dict[int, list[str]] = {}
    for t, s in zip(trained["traj_id"].to_pylist(), trained["trained_step"].to_pylist()):
        by_step.setdefault(s, []).append(t)
    return trained, by_step


@contextlib.contextmanager
def _trainer_and_buffer(tiny_model, run, name: str, trainer_cls=None):
    """A cluster of worker processes (env, trainer), a trainer (``trainer_cls`` in place
    of the graph's, if given) that published v0, a buffer on the env worker and an async
    pipeline over them with a Supervisor; yields ``(cluster, client, pipeline)``. Worker
    processes: a kill is a SIGKILL (an in-process worker's closed trainer would finish
    its step and publish, as a worker cut off by the network might)."""
    import dataclasses

    from distributed import Client

    from rollart import GRPO, Graph, Policy
    from rollart.control.modes import AsyncPipeline
    from rollart.control.fleet import Fleet
    from rollart.runtime.resources import Pool, Resources, workers_with
    from rollart.control.stages import Actors, Stages
    from rollart.types import TRAIN

    graph = Graph(name=name, tasks=("gridnav",), policy=Policy(warmup_steps=0),
                  algo=GRPO(group_size=4, groups_per_step=4, alpha=1, micro_batch_tokens=0))
    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env"),
                           Pool("trainer", tag=TRAIN, kind="trainer")),
                    processes=True, dashboard_address=":0")
    with res.make_cluster() as cluster, Client(cluster) as client:
        stages = Stages(client, graph, tiny_model, run)
        spec = stages.spec("trainer")
        if trainer_cls is not None:
            spec = dataclasses.replace(spec, cls=trainer_cls)
        trainer = stages.submit(spec, workers_with(client, TRAIN)[0], None).result()
        buf = client.submit(SampleBuffer, str(run), actor=True,
                            workers=workers_with(client, CPU_ENV)).result()
        actors = Actors(trainer, buf, [], [])
        pipeline = AsyncPipeline(Fleet(actors, stages), graph)  # replaces from the specs
        assert trainer.publish().result() == 0
        yield cluster, client, pipeline


def test_trainer_killed_mid_step_trains_nothing_unpublished(tiny_model, tmp_path):
    import hashlib

    run = tmp_path / "run"
    rng = random.Random(0)
    with _trainer_and_buffer(tiny_model, run, "t-killed") as (cluster, client, pipeline):
        actors, trainer, buf = pipeline.actors, pipeline.actors.trainer, pipeline.actors.buffer
        ids = []
        for g in range(12):  # three steps' worth (the third's fresh enough for version 2)
            trajs = [_long(f"g{g:02d}", i, rng, 0 if g < 8 else 1) for i in range(4)]
            ids += [t.traj_id for t in trajs]
            _put(buf, trajs)
        first = pipeline.train(1)
        killed: list = []
        killer = threading.Thread(target=_kill_when_taken, daemon=True,
                                  args=(cluster, client, buf, actors.trainer._address, killed))
        killer.start()
        second = pipeline.train(2)  # the trainer dies in it; the step is re-run
        killer.join(30)
        assert killed and pipeline.trainer_recoveries == 1
        assert actors.trainer is not trainer
        # the lost step published nothing: the new trainer restored version 1
        assert (first["version"], second["version"]) == (1, 2)
        third = pipeline.train(3)
        c = buf.counts().result()
        buf.close().result()
    trained, by_step = _trained_by_step(run)
    # every trained row belongs to a published update, and each update's rows are
    # exactly the batch the trainer reports it trained on
    assert sorted(by_step) == [1, 2, 3]
    for m in (first, second, third):
        got = by_step[m["step"]]
        assert len(got) == m["trainer/batch_size"] == 16
        digest = hashlib.sha1("\n".join(sorted(got)).encode()).hexdigest()[:16]
        assert digest == m["trainer/batch_sha1"], m["step"]
    assert len(trained) == len(set(trained["traj_id"].to_pylist())) == 48
    assert set(trained["traj_id"].to_pylist()) == set(ids)
    assert (c["trained"], c["taken"], c["lost_in_step"], c["buffered"]) == (48, 0, 0, 0)


class _DiesAfterPublishing:
    """Fault injection: a real ``Trainer`` whose process exits (as a SIGKILL would end
    it) at step 2 right after its update was published, before the buffer heard of it."""

    @staticmethod
    def make():
        from rollart.trainer.trainer import Trainer

        class DiesAfterPublishing(Trainer):
            async def _confirm(self, buffer, step, take):
                if step == 2:
                    import os

                    os._exit(1)
                return await super()._confirm(buffer, step, take)
        return DiesAfterPublishing


def test_a_trainer_lost_after_publishing_records_its_step_once(tiny_model, tmp_path):
    """The trainer's process dies after step 2's update was published but before it
    confirmed the batch: the update is in the weights its replacement loads, so step 2
    stands with the batch the buffer handed out, and is not re-run (a re-run trained a
    second batch under the same step number, which no trainer record vouched for)."""
    import sys

    import cloudpickle

    from rollart.buffer.schema import batch_digest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the class, to workers
    run = tmp_path / "run"
    rng = random.Random(1)
    with _trainer_and_buffer(tiny_model, run, "t-published",
                             _DiesAfterPublishing.make()) as (_, _, pipeline):
        actors, trainer, buf = pipeline.actors, pipeline.actors.trainer, pipeline.actors.buffer
        ids = []
        for g in range(16):  # four steps' worth: a re-run of step 2 still lets 3 finish
            trajs = [_long(f"g{g:02d}", i, rng, (0, 0, 1, 2)[g // 4]) for i in range(4)]
            ids += [t.traj_id for t in trajs]
            _put(buf, trajs)
        steps = [pipeline.train(s) for s in (1, 2, 3)]
        assert pipeline.trainer_recoveries == 1 and actors.trainer is not trainer
        c = buf.counts().result()
        buf.close().result()
    assert [m["version"] for m in steps] == [1, 2, 3]
    assert steps[1].get("trainer/published_before_loss") == 1
    # its figures from the buffer's record: rewards 0, 1, 0, 1 in each group of 4
    assert (steps[1]["step"], steps[1]["reward/gridnav"]) == (2, 0.5)
    trained, by_step = _trained_by_step(run)
    assert sorted(by_step) == [1, 2, 3]
    for step, m in zip((1, 2, 3), steps):  # each step's rows are the batch it reports
        assert len(by_step[step]) == m["trainer/batch_size"] == 16, step
        assert batch_digest(by_step[step]) == m["trainer/batch_sha1"], step
    assert sorted(trained["traj_id"].to_pylist()) == sorted(ids[:48])
    assert (c["trained"], c["taken"], c["buffered"]) == (48, 0, 16)


def test_a_trainer_lost_after_its_step_is_replaced_for_the_checkpoint(tiny_model, tmp_path):
    """The trainer's worker dies after its step returned, before that step's checkpoint
    (chaos.py's mid-step kill can land there): the checkpoint heals the run (a new
    trainer, holding the step's published version) and is written, where it ended the
    run with "Worker holding Actor was lost"."""
    from rollart.control import checkpoint
    from rollart.control.supervisor import lose_worker

    rng = random.Random(2)
    with _trainer_and_buffer(tiny_model, tmp_path / "run", "t-ckpt") as (
            cluster, client, pipeline):
        actors, trainer, buf = pipeline.actors, pipeline.actors.trainer, pipeline.actors.buffer
        for g in range(4):
            _put(buf, [_long(f"g{g}", i, rng, 0) for i in range(4)])
        first = pipeline.train(1)
        lose_worker(cluster, client, trainer._address)  # SIGKILL: worker processes
        path = checkpoint.save(str(tmp_path / "ckpt"), 1, actors, pipeline=pipeline)
        assert actors.trainer is not trainer and pipeline.trainer_recoveries == 1
        buf.close().result()
    ckpt = checkpoint.load(path)
    assert (first["version"], ckpt.step, ckpt.version) == (1, 1, 1)


def test_a_call_on_a_worker_closed_just_now_fails_over_at_once(tiny_model, tmp_path):
    """The driver asks the sample buffer for its counts again and again while the
    buffer's in-process worker closes (chaos.py's trainer kill: the buffer lives on the
    trainer's worker). A call that reached the scheduler just as the worker closed was
    retried by it until Dask's connect time-out (300 s in chaos.py, the setting here):
    the run sat in ``Pipeline.counts`` (now ``Fleet.sample``) and was killed as hung. Now every call answers
    within seconds: from the old buffer, or from the one recovered on the other worker."""
    import dask
    from distributed import Client

    from rollart import GRPO, Graph, Policy
    from rollart.runtime.handles import handle
    from rollart.control.modes import AsyncPipeline
    from rollart.control.fleet import Fleet
    from rollart.control.supervisor import lose_worker
    from rollart.runtime.resources import Pool, Resources, workers_with
    from rollart.control.stages import Actors, Stages
    from rollart.types import BUFFER, REWARD, TRAIN

    graph = Graph(name="t-closed", tasks=("gridnav",), policy=Policy(warmup_steps=0),
                  algo=GRPO(group_size=2, groups_per_step=1))
    res = Resources(pools=(Pool("reward", tag=REWARD, kind="reward", extra_tags={BUFFER: 1}),
                           Pool("trainer", tag=TRAIN, kind="trainer")),
                    processes=False, dashboard_address=":0")
    with dask.config.set({"distributed.comm.timeouts.connect": "300s"}), \
            res.make_cluster() as cluster, Client(cluster) as client:
        stages = Stages(client, graph, tiny_model, tmp_path / "run")
        old = workers_with(client, BUFFER)[0]
        buf = handle(stages.submit(stages.spec("buffer"), old, None).result())
        actors = Actors(None, buf, [], [])
        pipeline = AsyncPipeline(Fleet(actors, stages), graph)
        _put(buf, [make("g0", i, 0) for i in range(2)], size=2)
        killer = threading.Thread(target=lose_worker, args=(cluster, client, old),
                                  kwargs={"restart_after": None})
        slowest, calls, stop = [0.0], [], threading.Event()

        def ask():
            while not stop.is_set():
                t0 = time.monotonic()
                calls.append(pipeline.fleet.sample(workers=False, managers=False)
                             .buffer["buffered"])
                slowest[0] = max(slowest[0], time.monotonic() - t0)

        def answered(n: int, within: float) -> bool:
            end = time.monotonic() + within
            while len(calls) < n and time.monotonic() < end:
                time.sleep(0.01)
            return len(calls) >= n

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        assert answered(3, 30)
        killer.start()  # the calls go on while the worker closes
        killer.join(60)
        assert answered(len(calls) + 20, 90), f"a counts call hung ({len(calls)} answered)"
        stop.set()
        asker.join(30)
        assert slowest[0] < 30 and set(calls) == {2}, (slowest, calls)
        assert actors.buffer is not buf and actors.buffer._address == \
            workers_with(client, TRAIN)[0]
        actors.buffer.close().result()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_both_trainer_backends_confirm_after_publishing(backend, local_cluster, tiny_model,
                                                        tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from rollart import GRPO
    from rollart.trainer import trainer_class
    from rollart.types import TRAIN
    from rollart.weights import WeightStore

    c, store, run = local_cluster, str(tmp_path / "weights"), str(tmp_path / "run")
    trainer = c.submit(trainer_class(backend), tiny_model, store,
                       GRPO(group_size=2, groups_per_step=2), actor=True,
                       resources={TRAIN: 1}, key=f"trainer-{uuid.uuid4().hex}").result()
    buf = c.submit(SampleBuffer, run, actor=True, resources={CPU_ENV: 1},
                   key=f"buf-{uuid.uuid4().hex}").result()
    trainer.publish().result()
    rng = random.Random(1)
    for g in range(2):
        _put(buf, [_long(f"m{g}", i, rng, 0) for i in range(2)], size=2)
    m = trainer.train_step(buf, 1, timeout=60).result()
    assert WeightStore(store).latest() == m["version"] == 1
    counts = buf.counts().result()
    assert (counts["trained"], counts["taken"]) == (4, 0)
    assert {s for s in states(run).values()} == {("trained", 1)}


def test_a_torn_journal_file_is_skipped_and_nothing_is_called_trained_on_a_guess(tmp_path):
    """The entry that released a batch is unreadable (cut short by a crash): replaying
    the rest says the batch is taken, but no newer entry lists its step, so the
    recovered buffer re-uses it instead of assuming its update was published."""
    from rollart.buffer.journal import entries

    run = str(tmp_path)

    async def scenario():
        buf = SampleBuffer(run)
        for i in range(2):
            await buf.put(make("a", i, 5), 2)
        await buf.get_table(1, 4, trained_step=1)
        n = len(entries(run, "ledger"))
        await buf.release_taken(1, 4)  # entry n: back to buffered
        await buf.launched(["z-0"])  # entry n + 1
        path = dict(entries(run, "ledger"))[n]
        with open(path, "r+b") as f:
            f.truncate(20)
        new = SampleBuffer(run, recover=True)
        assert new.recovered["taken"] == 2
        got = await new.get_table(1, 5, trained_step=1)  # even one version on
        assert got.column("traj_id").to_pylist() == ["a-0", "a-1"]
        assert (await new.counts())["trained"] == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("cut", ["missing", "torn"])
def test_rows_of_an_entry_never_made_are_in_no_reading(cut, tmp_path):
    """The buffer's worker dies between an entry's ``pending/`` rows and its ``ledger/``
    file (or the ledger file is cut short): that entry was never made. Its group's
    members count as lost (failed, orphaned) and no reader shows a row for them: not the
    recovered buffer, not ``read_samples`` after that buffer wrote entries of its own
    (the first one under the same number), not a compaction. Before, the recovered
    buffer's first entry made the dead one's rows its own, and the run's record showed
    ``failed`` rows for trajectories it counted lost (the kill matrix's ``hand-TRAIN``
    cell in CI)."""
    from rollart.buffer.journal import entries

    run = str(tmp_path)

    async def scenario():
        buf = SampleBuffer(run, flush_every=1000)
        await buf.launched(["a-0", "a-1", "b-0", "b-1"])
        for i in range(2):
            await buf.put(make("b", i, 0), 2)  # b: durable
        await buf.put(make("a", 0, 0), 2)
        await buf.put(make("a", 1, 0), 2)  # a's entry: rows, then ledger
        n = max(dict(entries(run, "ledger")))
        assert n in dict(entries(run, "pending"))
        ledger = dict(entries(run, "ledger"))[n]
        if cut == "missing":
            import os
            os.remove(ledger)
        else:
            with open(ledger, "r+b") as f:
                f.truncate(20)
        new = SampleBuffer(run, recover=True, flush_every=1000)
        assert new.recovered["orphaned"] == 2 and new.recovered["buffered"] == 2
        c = await new.counts()
        assert (c["failed"], c["orphaned"], c["buffered"]) == (2, 2, 2), c
        assert states(run) == {"b-0": ("buffered", None), "b-1": ("buffered", None)}
        await new.put(make("a", 1, 0), 2)  # a late report of a lost member: ignored
        await new.launched(["c-0"])  # more entries from the recovered buffer
        got = await new.get_table(1, 0, trained_step=1)
        assert sorted(got.column("traj_id").to_pylist()) == ["b-0", "b-1"]
        await new.mark_trained(1)
        await new.snapshot(f"{run}/ckpt")  # compacts the journal
        await new.close()
        assert states(run) == {"b-0": ("trained", 1), "b-1": ("trained", 1)}
        c = await new.counts()
        rows = Counter(read_samples(run).column("state").to_pylist())
        assert rows["failed"] == c["failed"] - c["orphaned"] == 0, (rows, c)

    asyncio.run(scenario())


# -- a trainer replaced mid-run keeps every published version ----------------------------
@pytest.mark.slow
def test_a_replaced_trainer_continues_from_the_newest_published_version(tiny_model, tmp_path):
    """Checkpoint at step 2, train steps 3 and 4, SIGKILL the trainer's worker: the new
    trainer loads the checkpoint (optimizer, RNG) without truncating the store and the
    newest published weights on top, so versions 3 and 4 (whose rows are ``trained``)
    are kept and step 5 publishes version 5, not a second version 3."""
    import pyarrow.compute as pc
    from distributed import Client

    from rollart import GRPO, Graph, Policy
    from rollart.control import checkpoint
    from rollart.control.modes import AsyncPipeline
    from rollart.control.fleet import Fleet
    from rollart.control.supervisor import lose_worker
    from rollart.runtime.resources import Pool, Resources, workers_with
    from rollart.control.stages import Actors, Stages
    from rollart.types import TRAIN
    from rollart.weights import WeightStore

    graph = Graph(name="t-no-rollback", tasks=("gridnav",), policy=Policy(warmup_steps=0),
                  algo=GRPO(group_size=2, groups_per_step=2, alpha=1, micro_batch_tokens=0))
    res = Resources(pools=(Pool("env", tag=CPU_ENV, kind="cpu_env"),
                           Pool("trainer", tag=TRAIN, kind="trainer")),
                    processes=True, dashboard_address=":0")
    run, ckpts = tmp_path / "run", str(tmp_path / "ckpt")
    rng = random.Random(3)
    with res.make_cluster() as cluster, Client(cluster) as client:
        stages = Stages(client, graph, tiny_model, run)
        trainer = stages.submit(stages.spec("trainer"), workers_with(client, TRAIN)[0],
                                None).result()
        buf = client.submit(SampleBuffer, str(run), actor=True,
                            workers=workers_with(client, CPU_ENV)).result()
        actors = Actors(trainer, buf, [], [])
        pipeline = AsyncPipeline(Fleet(actors, stages, checkpoint_url=ckpts), graph)
        sup = pipeline.supervisor
        assert trainer.publish().result() == 0
        out = {}
        for step in range(1, 6):
            for g in range(2):  # fresh groups for this step (version = trainer's)
                _put(buf, [_long(f"s{step}g{g}", i, rng, step - 1) for i in range(2)],
                     size=2)
            if step == 5:  # between steps: the next train_step finds its trainer gone
                lose_worker(cluster, client, actors.trainer._address)
            out[step] = pipeline.train(step)
            if step == 2:
                checkpoint.save(ckpts, 2, actors, pipeline=pipeline)
        assert pipeline.trainer_recoveries == 1 and actors.trainer is not trainer
        event = next(e for e in sup.events if e["role"] == "trainer")
        new_version = actors.trainer.stats().result()["version"]
        buf.close().result()
    assert event["version"] == 4, event  # the newest published, not the checkpoint's 2
    assert "checkpoint" in event["restored_from"] and "weights v4" in event["restored_from"]
    assert [out[s]["version"] for s in range(1, 6)] == [1, 2, 3, 4, 5]
    assert new_version == 5
    store = WeightStore(str(run / "weights"))
    kept, latest = store.versions(), store.latest()
    assert latest == 5 and 4 in kept
    samples = read_samples(str(run))
    trained = samples.filter(pc.equal(samples["state"], "trained"))
    steps = trained["trained_step"].to_pylist()
    assert sorted(set(steps)) == [1, 2, 3, 4, 5] and len(steps) == 20
    for s in set(steps):  # step s published version s: kept, or superseded (gc'd, older)
        assert s in kept or s < min(kept), (s, kept)
        got = [t for t, k in zip(trained["traj_id"].to_pylist(), steps) if k == s]
        assert len(got) == out[s]["trainer/batch_size"] == 4


def test_the_dashboards_state_chart_shows_taken_and_lost_in_step(local_cluster, tmp_path):
    """``rollart.observe.monitor.Monitor`` snapshots (the dashboard's state chart) count a batch
    ``taken`` while its update is unpublished and ``lost_in_step`` once it is given up.
    (On the module's cluster: a second in-process cluster's actor calls hung once, with
    the first one's client still open.)"""
    from rollart import Graph
    from rollart.observe.metrics import TRAJ_STATES
    from rollart.observe.monitor import Monitor
    from rollart.control.fleet import Fleet
    from rollart.control.stages import Actors

    c = local_cluster
    buf = c.submit(SampleBuffer, str(tmp_path / "run"), actor=True,
                   resources={CPU_ENV: 1}, key=f"buf-{uuid.uuid4().hex}").result()
    _put(buf, [make("g0", i, 0) for i in range(2)], size=2)
    _put(buf, [make("g1", i, 0) for i in range(2)], size=2)
    buf.get_table(1, 0, trained_step=1).result()
    monitor = Monitor(c, Fleet(Actors(None, buf, [], [])), Graph(name="t-chart"), "t-chart",
                      interval=60)
    try:
        taken = monitor.sample()["states"]
        buf.close().result()  # the unconfirmed batch: lost_in_step
        lost = monitor.sample()["states"]
    finally:
        monitor.close()
    assert {"taken", "lost_in_step"} <= set(TRAJ_STATES)
    assert (taken["taken"], taken["buffered"], taken["lost_in_step"]) == (2, 2, 0)
    assert (lost["taken"], lost["lost_in_step"]) == (0, 2)
