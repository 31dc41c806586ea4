"""``SampleBuffer``: a Dask actor that turns finished trajectories into GRPO batches.

Consumes ``Trajectory`` records one at a time (``put``, called by the rollout side) and
hands out complete, bounded-stale groups to the ``Trainer`` (``get_table``: one Arrow
table; ``get_batch``: the same as records). Buffered rows are held as Arrow record
batches in ``rollart.buffer.schema.SCHEMA``, one per group once it completes.

A batch taken for trainer step ``s`` is ``taken`` until ``mark_trained(s)`` confirms its
update published, or settled (``release_taken``, next ``get_table``: ``Handout``).

The actor wires together plain parts, each with its own state (none touches another's):

    ledger     Ledger        each trajectory's state          rollart.buffer.ledger
    groups     Groups        open, complete, closed groups    rollart.buffer.group
    taken      TakenBatches  what each trainer step holds     rollart.buffer.taken
    handout    Handout       takes, confirms, settles; waits  rollart.buffer.handout
    arrivals   Arrivals      counters, lost ids, fail streak  rollart.buffer.arrivals
    infra      InfraFailures failed members, too-small groups rollart.buffer.infra
    admission  Admission     async mode's slots (acquire)     rollart.buffer.backpressure
    journal    Journal       pending/ rows, ledger/ changes   rollart.buffer.journal
    store      BufferStore   samples/ parts, the I/O thread   rollart.buffer.store

``SampleBuffer(run_dir, recover=True)`` continues from the journal and parts after the
previous buffer's worker was lost (``rollart.buffer.restore``); ``min_group``: see
``rollart.buffer.infra``. The trainer waits on the actor's one asyncio condition (the
handout's). All public methods are coroutines on the worker's loop.
"""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa

from rollart.buffer import restore as recovery
from rollart.buffer.arrivals import Arrivals, is_failed
from rollart.buffer.backpressure import ACQUIRE_WAIT, Admission, next_group
from rollart.buffer.group import TAKE_KEY, Group, Groups, restate
from rollart.buffer.handout import Handout
from rollart.buffer.infra import InfraFailures
from rollart.buffer.journal import Journal
from rollart.buffer.ledger import Ledger
from rollart.buffer.schema import SCHEMA, from_table, generated_tokens, to_record_batch
from rollart.buffer.store import BufferStore
from rollart.buffer.taken import TakenBatches, row_ids
from rollart.policy.redundancy import min_members
from rollart.types import Trajectory, TrajState

__all__ = ["TAKE_KEY", "SampleBuffer"]  # TAKE_KEY: the trainer reads a batch's hand-out
logger = logging.getLogger(__name__)

BUFFERED = TrajState.BUFFERED.value
#: rows leaving in these states were never trained on: their generated tokens are wasted
NEVER_TRAINED = (TrajState.DROPPED, TrajState.FAILED, TrajState.LOST_IN_STEP)


class SampleBuffer:
    """Groups trajectories by ``group_id`` and serves bounded-stale GRPO batches.

    Use as a Dask actor: ``client.submit(SampleBuffer, run_dir, actor=True)``; after its
    worker was lost, ``client.submit(SampleBuffer, run_dir, recover=True, actor=True)``
    (same other arguments) continues from what the lost one made durable.
    """

    def __init__(self, run_dir: str | None = None, *, flush_every: int = 256,
                 recover: bool = False, min_group: int = 2):
        self.run_dir = str(run_dir).rstrip("/") if run_dir is not None else None
        self.min_group = int(min_group)
        self.ledger = Ledger()
        self.groups = Groups()
        self.taken = TakenBatches()
        self.arrivals = Arrivals()
        self.infra = InfraFailures()
        self.admission = Admission()
        self.store = BufferStore(self.run_dir, flush_every)
        self.journal = Journal(self.run_dir, self.store)
        self.handout = Handout(self.ledger, self.groups, self.taken, self.admission, self._leave)
        self.ended = False  # the run's end was called (orphan_all_in_flight): no launches
        self.wasted_tokens = 0  # generated tokens of rows that left never trained (_leave)
        self.recovered: dict | None = self._recover() if recover else None  # what it found

    # -- wiring -------------------------------------------------------------------------
    def _leave(self, batches: list[pa.RecordBatch], state: TrajState, step: int | None = None,
               durable: bool = False) -> list[pa.RecordBatch]:
        """Rows that leave the buffer: ledger moves, queued for Parquet (and for the
        journal unless ``durable``: a complete group's rows already are)."""
        out = [restate(b, state.value, step) for b in batches if b.num_rows]
        if state in NEVER_TRAINED:
            self.wasted_tokens += generated_tokens(out)
        for traj_id in row_ids(out):
            self.ledger.move(traj_id, state.value, step)
        self.store.left(out)
        if not durable:
            self.journal.add_rows(out)
        return out

    def _entry(self) -> asyncio.Future | None:
        """Start the next journal entry (the ledger's changes since the last one)."""
        return self.journal.entry(self.ledger.drain(), self._meta())

    def _meta(self) -> dict:
        return {"counts": self.arrivals.record(), "ledger": dict(self.ledger.counts),
                "taken": self.taken.meta(), "infra": self.infra.tasks()}

    async def _durable(self, fut: asyncio.Future | None) -> None:
        """Wait for the journal entry ``fut``, then write a part if enough rows wait."""
        await self.store.wait(fut)
        await self.store.maybe_flush()

    def _arrived(self, traj: Trajectory) -> bool:
        """Book an arrival: False for one given up as lost (ignored). One never launched
        (a buffer fed without env managers: tests, tools) is counted ``unannounced``."""
        if self.arrivals.ignore(traj.traj_id):
            return False
        self.ledger.adopt(traj.traj_id)
        self.arrivals.received(traj)
        return True

    def _add(self, traj: Trajectory, group_size: int) -> bool:
        """Book one arrival; True when it completed a group with trainable members."""
        if not self._arrived(traj):
            return False
        gid, failed = traj.group_id, is_failed(traj)
        if failed:  # infrastructure's: dropped from its group (rollart.buffer.infra)
            traj.state = TrajState.FAILED.value
            self.infra.failed(traj.task, rerun=False)
        if self.groups.ended(gid):
            logger.warning("late member %s of group %s dropped", traj.traj_id, gid)
            state = TrajState.FAILED if failed else TrajState.DROPPED
            self._leave([to_record_batch([traj])], state)
            return False
        group = self.groups.arrive(gid, group_size, traj.task)
        group.arrived += 1
        self.arrivals.noted(traj, failed)
        if failed:
            self._leave([to_record_batch([traj])], TrajState.FAILED)
        else:
            traj.state = BUFFERED
            self.ledger.move(traj.traj_id, BUFFERED)
            group.add(traj)
        if not group.complete:
            return False
        if not self.groups.completed(group, min_members(self.min_group, group.size)):
            self._too_small(group)
            return False
        self.journal.add_rows(group.arrow())
        return True

    def _too_small(self, group: Group) -> None:
        """Failed members left ``group`` too few to train on: its rows leave as
        ``dropped``, counted; its slot frees."""
        self.infra.too_small(group.task)
        self._leave(group.arrow(), TrajState.DROPPED)
        self.admission.free(group.group_id)

    def _orphan(self, traj_ids: list[str]) -> None:
        """In-flight trajectories whose worker was lost become failed (``orphaned``)."""
        for t in traj_ids:
            self.ledger.move(t, TrajState.FAILED.value)
        self.arrivals.orphaned(traj_ids)
        self.journal.orphaned(traj_ids)

    async def _orphan_durably(self, traj_ids: list[str], why: str, *args) -> None:
        self._orphan(traj_ids)
        if traj_ids:
            logger.warning(why, *args)
            await self.store.wait(self._entry())

    def _counts_now(self) -> dict[str, int]:
        arrivals = self.arrivals.counts()
        return {**self.ledger.check(), "received": arrivals["received"],
                "groups_complete": self.groups.ready(), "orphaned": arrivals["orphaned"],
                "ignored": arrivals["ignored"], "unannounced": self.ledger.counts["unannounced"],
                "failed_streak": self.arrivals.streak}  # failed arrivals since the last good one

    def _parts(self) -> dict:
        return dict(ledger=self.ledger, groups=self.groups, taken=self.taken,
                    arrivals=self.arrivals, store=self.store, journal_=self.journal)

    def _recover(self) -> dict:
        """Load the journal under ``run_dir`` (in the constructor's thread)."""
        if self.run_dir is None:
            raise ValueError("SampleBuffer(recover=True) needs the run_dir of the buffer it "
                             "replaces")
        rec = recovery.read_journal(self.run_dir)
        recovery.load_recovered(rec, **self._parts())
        self.infra.load(rec.meta.get("infra"))
        lost = self.ledger.in_flight()
        self._orphan(lost)
        self.journal.entry_now(self.ledger.drain(), self._meta())
        found = {"entries": rec.next_entry, "buffered": self.groups.rows(), "taken":
                 self.taken.rows(), "orphaned": len(lost), "rewritten": rec.rewritten}
        if rec.next_entry:
            logger.warning("sample buffer recovered from %s: %s", self.run_dir, found)
        return found

    # -- public API: rollout side -------------------------------------------------------
    async def put(self, traj: Trajectory, group_size: int) -> None:
        """Add one finished trajectory of a group of ``group_size`` members. When it
        completes its group, the group is durable (journaled) before this returns."""
        (err,) = await self.put_many([(traj, group_size)])
        if err is not None:
            raise err

    async def put_many(self, items: list[tuple[Trajectory, int]]) -> list:
        """``put`` for several ``(trajectory, group_size)`` in one call (an env manager
        sends a group's members together: ``EnvManager(put_linger=…)``,
        ``rollart.runtime.coalesce``). Each is booked as ``put`` books it; the groups
        they completed are durable (one journal entry) before this returns. Returns, per
        item, ``None`` or the error booking it raised; the others are booked regardless."""
        errors: list[Exception | None] = []
        completed = False
        async with self.handout.condition:
            for traj, group_size in items:
                try:
                    completed |= self._add(traj, group_size)
                except Exception as e:  # noqa: BLE001 - that item's caller gets it
                    errors.append(e)
                else:
                    errors.append(None)
            fut = self._entry() if completed else None
            if completed or self.admission.take_limit() is not None:
                self.handout.wake()  # an ended group may have moved the window
        await self._durable(fut)
        return errors

    async def launched(self, traj_ids: list[str]) -> None:
        """Record trajectories an env manager has started (durably, before this returns:
        one write per call, and managers launch a group's members in one call). Refused
        once the run ended (``orphan_all_in_flight``): a launch then could never settle
        and would be left in flight in the final counts."""
        if self.ended:
            raise RuntimeError(f"the run has ended: the sample buffer takes no new "
                               f"trajectories ({', '.join(traj_ids[:3])}…)")
        for t in traj_ids:
            self.ledger.launch(t)
        await self.store.wait(self._entry())

    async def settle(self, traj_ids: list[str], state: str) -> None:
        """Record trajectories that ended outside the buffer (cancelled or aborted)."""
        if state not in (TrajState.CANCELLED.value, TrajState.ABORTED.value):
            raise ValueError(f"settle() takes 'cancelled' or 'aborted', not {state!r}")
        for t in traj_ids:
            if self.arrivals.ignore(t):
                continue
            self.ledger.adopt(t)  # never launched here: it ends as it is reported
            self.ledger.move(t, state)
        self.journal.soon(self._entry)

    async def record_failed(self, traj: Trajectory) -> None:
        """A failed member its env manager replaced: counted and written as ``failed``,
        without taking a place in its group."""
        if not self._arrived(traj):
            return
        traj.state = TrajState.FAILED.value
        self.arrivals.noted(traj, True)
        self.infra.failed(traj.task, rerun=True)
        self._leave([to_record_batch([traj])], TrajState.FAILED)
        self.journal.soon(self._entry)
        await self.store.maybe_flush()

    async def orphan_all_in_flight(self, error: str = "lost with its worker") -> int:
        """End of run, after every live env manager settled its members: whatever the
        ledger still has in flight ran on a manager that was lost; those become
        ``failed`` (counted in ``orphaned``). Returns how many. From here on no
        trajectory is launched (``launched`` refuses): an env manager still running on a
        lost worker's remains (an in-process worker closed under it) would otherwise add
        one in flight while this call waits for its journal entry."""
        self.ended = True
        lost = self.ledger.in_flight()
        await self._orphan_durably(lost, "%d trajectories were still in flight on lost "
                                   "workers (%s)", len(lost), error)
        return len(lost)

    async def orphan_group(self, group_id: str, error: str = "worker lost") -> dict:
        """A group's env manager was lost: its members still in flight there will never
        arrive, so they become ``failed``. Returns ``{"failed": n, "arrived": k,
        "complete": bool}`` so the driver can restart the ``size - k`` missing members
        elsewhere."""
        lost = self.ledger.in_flight(f"{group_id}-")
        await self._orphan_durably(lost, "group %s: %d in-flight members lost with their "
                                   "worker (%s)", group_id, len(lost), error)
        return {"failed": len(lost), "arrived": self.groups.arrived(group_id),
                "complete": self.groups.ended(group_id)}

    # -- public API: trainer side -------------------------------------------------------
    async def get_batch(self, n_groups: int, min_version: int, timeout: float | None = None,
                        trained_step: int | None = None) -> list[Trajectory]:
        """Wait for ``n_groups`` complete groups of version >= ``min_version``; take them.

        Complete groups older than ``min_version`` are dropped on the way. Returns the
        groups' trajectories (oldest completed group first), ``taken`` for step
        ``trained_step`` until ``mark_trained(trained_step)`` (``trained`` at once when
        ``trained_step`` is None). Raises ``TimeoutError`` when ``timeout`` seconds pass.
        """
        return from_table(await self.get_table(n_groups, min_version, timeout, trained_step))

    async def get_table(self, n_groups: int, min_version: int, timeout: float | None = None,
                        trained_step: int | None = None) -> pa.Table:
        """``get_batch`` as one Arrow table in ``SCHEMA`` (what the ``Trainer`` pulls:
        Dask sends a table as a few buffers, and turning rows back into records is left
        to the receiving side instead of the buffer's worker, which also runs rollout).
        Batches still taken by earlier steps are settled first (``release_taken``)."""
        if n_groups <= 0:
            return SCHEMA.empty_table()
        batch, fut = await self.handout.take(n_groups, min_version, timeout, trained_step,
                                             self._counts_now, self._entry)
        await self._durable(fut)  # taken is durable before the trainer sees the batch
        return batch

    async def mark_trained(self, step: int, take: str | None = None) -> int:
        """The trainer published the update of step ``step``: its taken rows become
        ``trained`` (durably, before this returns). ``take``: the batch's
        ``TAKE_KEY`` metadata; a confirmation for another hand-out of ``step`` than the
        one taken now is refused (its step was settled, and maybe re-run, meanwhile).
        Returns rows confirmed; 0 when nothing (or another hand-out) is taken for it."""
        async with self.handout.condition:
            n = self.handout.confirm(step, take)
            fut = self._entry() if n else None
        await self._durable(fut)
        return n

    async def release_taken(self, step: int, min_version: int,
                            trained_on: int | None = None) -> dict:
        """Step ``step`` was lost with its trainer; its replacement trains at
        ``min_version`` (= its version - alpha). If that trainer holds a newer version
        than the batch was taken for, the lost step's update was published: the rows
        are ``trained`` and the step is done, not re-run; otherwise its groups are buffered
        again, first in line (``Handout.settle``). Returns ``{"trained": n, "buffered": n,
        ...}`` (rows; ``batch_sha1``, and ``metrics`` when ``trained_on`` is given)."""
        async with self.handout.condition:
            if step not in self.taken:
                return {"trained": 0, "buffered": 0}
            out = self.handout.release(step, min_version, trained_on)
            fut = self._entry()
        await self._durable(fut)
        return out

    async def abort_older_than(self, min_version: int) -> int:
        """Drop groups (complete or not) whose arrived members are older than
        ``min_version``; their later members are dropped on arrival. Returns rows dropped."""
        async with self.handout.condition:
            stale = self.handout.abort_older_than(min_version)
            fut = self._entry() if stale else None
        await self._durable(fut)
        return sum(g.rows for g, _ in stale)

    # -- public API: slots (async mode) -------------------------------------------------
    async def open_slots(self, slots) -> dict:
        """Start handing out groups under ``slots`` (a ``Slots``); a buffer that has its
        slots keeps them. The groups this buffer holds complete (restored from a
        checkpoint, or recovered) hold slots; the sequence continues after the last
        group its ledger knows. Returns ``slot_stats()``."""
        known = list(self.ledger.state) + list(self.groups.closed) + list(self.groups.complete)
        self.admission.open(slots, list(self.groups.complete), next_group(known))
        return await self.slot_stats()

    async def resize_slots(self, capacity: int) -> dict:
        """At most ``capacity`` groups hold a slot from now on (a shrink stops no group
        that runs: ``Slots.resize``). Returns ``slot_stats()``."""
        self.admission.resize(capacity)
        return await self.slot_stats()

    async def acquire(self, holder: str, tasks=None, wait: float = ACQUIRE_WAIT):
        """The next group for env manager ``holder`` (running the task names ``tasks``,
        or any) once a slot is free; None after ``wait`` s without one (ask again); False
        at once for a holder reported lost or a closing buffer (stop asking)."""
        return await self.admission.acquire(holder, tasks, wait, self.taken.in_training)

    async def retire_holder(self, holder: str) -> None:
        """Env manager ``holder`` is drained before its worker leaves
        (``rollart.control.scaling``): it gets no more groups; the ones it runs finish."""
        self.admission.retire(holder)

    async def holder_lost(self, holder: str) -> int:
        """Env manager ``holder`` was lost: its groups' members in flight there are
        ``failed`` (orphaned) and each group is handed out again for its missing
        members. Returns how many groups went back in line."""
        mine = self.admission.lose(holder)
        if mine is None:
            return 0
        lost = self.ledger.in_flight(tuple(f"{g}-" for g in mine))
        self._orphan(lost)
        if lost:
            await self.store.wait(self._entry())
        again = self.admission.hand_out_again(holder, {g: self.groups.seen(g) for g in mine})
        if again:
            logger.warning("env manager %s lost: %d groups go back in line (%d members "
                           "in flight failed)", holder, again, len(lost))
        return again

    async def end_group(self, group_id: str, error: str) -> None:
        """An env manager's ``run_group`` for ``group_id`` raised (not a trajectory's
        failure: those are counted as such): the group ends here, its slot frees."""
        self.arrivals.error(f"group {group_id}: {error}")
        group = self.groups.open.get(group_id)
        if group is not None:
            async with self.handout.condition:
                self.handout.drop([(group, False)])
            self.journal.soon(self._entry)
        self.admission.free(group_id)

    async def stop_task(self, task_name: str) -> None:
        """Draw no more groups of ``task_name``: it failed every trajectory for
        ``Rollout.failing_task_steps`` (the driver decides: ``rollart.policy.quarantine``)."""
        self.admission.stop_task(task_name)

    async def slot_stats(self) -> dict:
        """Slots held and their capacity, and the groups in flight or buffered counted
        from the ledger and the buffer's groups (not from the slots)."""
        running = {t.rsplit("-", 1)[0] for t in self.ledger.in_flight()}
        return {"groups_live": self.groups.live(running),
                "groups_buffered": self.groups.ready(), **self.admission.stats()}

    async def slot_state(self) -> dict | None:
        """The group sequence's state (for a checkpoint), None before ``open_slots``."""
        return self.admission.state()

    # -- public API: figures ------------------------------------------------------------
    async def counts(self) -> dict[str, int]:
        """Trajectory counts by state (checked against launches), received, and
        groups_complete. Raises ``AccountingError`` if the ledger does not add up."""
        return self._counts_now()

    async def recent_errors(self) -> list[str]:
        """What the latest failed trajectories said (newest last, at most 5)."""
        return self.arrivals.errors()

    async def size(self) -> int:
        """Trajectories held now (complete and incomplete groups)."""
        return self.groups.rows()

    async def stats(self) -> dict:
        """``counts()`` plus buffer internals: rows, Arrow bytes, groups, waiters, I/O."""
        return {
            **self._counts_now(),
            **self.groups.figures(),
            "tasks": self.arrivals.tasks(),  # per task: rollart.buffer.arrivals.TASK_COUNTS
            "infra": self.infra.tasks(),  # per task: rollart.buffer.infra.INFRA_COUNTS
            "first_errors": self.arrivals.first_errors(),  # per task: its first failure's text
            "stop": self.arrivals.stop(),  # a failure that stops the run (arrivals.STOPS_RUN)
            "taken_steps": self.taken.steps(),
            "waiters": self.handout.waiters,
            "groups_stale": self.handout.stale_groups,  # dropped as too stale, complete or not
            "pending_rows": self.store.pending_rows,
            "parts_started": self.store.parts,
            "journal_entries": self.journal.next_entry,
            "wasted_tokens": self.wasted_tokens,
            **await self.slot_stats(),
        }

    # -- public API: durability ---------------------------------------------------------
    async def flush(self) -> int:
        """Journal the ledger, write the rows that left so far, wait for all writes;
        returns parts started."""
        self._entry()
        self.store.write_part()
        await self.store.drain()
        return self.store.parts

    async def snapshot(self, url: str) -> dict:
        """Write the buffer's part of a checkpoint under ``url`` (``rollart.control.checkpoint``;
        ``rollart.buffer.restore.snapshot_of``), after a flush; then compact the journal.
        Returns the manifest entries."""
        async with self.handout.condition:
            await self.flush()
            meta = {**self._meta(), "next_part": self.store.parts,
                    "next_entry": self.journal.next_entry}
            table, meta = recovery.snapshot_of(self.groups, self.taken, meta)
        files = recovery.write_snapshot(url, table, meta)
        await self.journal.compact(meta["next_entry"])
        return files

    async def restore(self, url: str) -> int:
        """Continue from a snapshot written by ``snapshot``: complete groups buffered again,
        taken ones taken, incomplete ones dropped, in flight aborted, the old run's later
        files set aside (``rollart.buffer.restore.restore_state``). Returns rows buffered."""
        meta, table = recovery.read_snapshot(url)
        self.infra.load(meta.get("infra"))
        async with self.handout.condition:
            for g in recovery.restore_state(meta, table, self.run_dir, **self._parts()):
                self._leave(g.arrow(), TrajState.DROPPED)
            self.ledger.check()
            self.handout.wake()
        await self.flush()
        return self.groups.rows()

    async def close(self) -> None:
        """Flush and release the I/O thread. Batches still taken (their step neither
        confirmed nor settled) leave as ``lost_in_step``; buffered rows stay buffered
        (in the journal: ``read_samples`` shows them)."""
        self.admission.stop()
        async with self.handout.condition:
            self.handout.lose_taken()
        self.journal.cancel_soon()
        await self.flush()
        self.store.close()
