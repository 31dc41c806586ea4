"""``SampleBuffer``: a Dask actor that turns finished trajectories into GRPO batches.

Consumes ``Trajectory`` records one at a time (``put``, called by the rollout side) and
hands out complete, bounded-stale groups to the ``Trainer`` (``get_table``: one Arrow
table; ``get_batch``: the same as records). Buffered rows are held as Arrow record
batches in ``rollart.buffer.schema.SCHEMA``, one per group once it completes.

A batch taken for trainer step ``s`` is ``taken`` until the trainer confirms that the
update trained on it was published (``mark_trained(s)``); only then is it ``trained``.
A step that was lost is settled by ``release_taken(s, min_version)`` (the pipeline,
after it replaced the trainer) or, failing that, by the next ``get_table``: if the
trainer that asks already holds a newer version than the one the batch was taken for,
only the lost step's own update can have published it, so the batch is ``trained``;
otherwise its groups go back to the front of the queue for the re-run step (that
bookkeeping: ``rollart.buffer.taken.TakenBatches``, mixed in here).

The buffer keeps the run's ``Ledger`` (``rollart.buffer.ledger``; managers report
launches, cancellations and aborts here) and, when ``run_dir`` is set, makes it durable
through ``rollart.buffer.store``: parts ``samples/part-*.parquet`` of the rows that left
(final ``state`` and ``trained_step``) and a journal (``pending/`` rows of each group as
it completes, ``ledger/`` state changes; layout in ``rollart.buffer.journal``).
``SampleBuffer(run_dir, recover=True)`` continues from that record after the previous
buffer's worker was lost (``rollart.buffer.restore.recover``). In async mode the buffer
also owns the backpressure: ``max(alpha, 1) * groups_per_step`` slots that env managers
take groups from (``acquire``; ``rollart.buffer.backpressure``). All public methods are
coroutines that run on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict, deque

import pyarrow as pa

from rollart.buffer.backpressure import Backpressure
from rollart.buffer.group import Group, Taken, restate
from rollart.buffer.ledger import IN_FLIGHT, STATES, Ledger
from rollart.buffer.schema import SCHEMA, from_table, to_record_batch
from rollart.buffer.store import BufferStore
from rollart.buffer.taken import TakenBatches, _ids
from rollart.policy.staleness import within
from rollart.types import Trajectory, TrajState

logger = logging.getLogger(__name__)

BUFFERED, TAKEN = TrajState.BUFFERED.value, TrajState.TAKEN.value
ENTRY_DELAY = 0.05  # s: the longest a cancellation or failure waits for the journal
TAKE_KEY = b"rollart_take"  # get_table's schema metadata: which hand-out this batch is


def _is_failed(traj: Trajectory) -> bool:
    failed = TrajState.FAILED.value
    return getattr(traj.state, "value", traj.state) == failed or traj.outcome == failed


class SampleBuffer(TakenBatches, Backpressure):
    """Groups trajectories by ``group_id`` and serves bounded-stale GRPO batches.

    Use as a Dask actor: ``client.submit(SampleBuffer, run_dir, actor=True)``; after its
    worker was lost, ``client.submit(SampleBuffer, run_dir, recover=True, actor=True)``
    (same other arguments) continues from what the lost one made durable.
    """

    def __init__(self, run_dir: str | None = None, *, flush_every: int = 256,
                 recover: bool = False):
        self.run_dir = str(run_dir).rstrip("/") if run_dir is not None else None
        self.store = BufferStore(self.run_dir, flush_every)
        self._open: dict[str, Group] = {}  # incomplete groups
        self._complete: OrderedDict[str, Group] = OrderedDict()  # FIFO by completion
        self._closed: set[str] = set()  # groups that left; late members are dropped
        self._taken: dict[int, Taken] = {}  # trainer step -> what it took
        self._orphans: set[str] = set()  # given up as lost: a late arrival is ignored
        # received: arrivals; orphaned: ids failed because their worker was lost;
        # ignored: arrivals of orphaned ids (a recovered buffer's late members)
        self._counts = dict(received=0, orphaned=0, ignored=0)
        # failed arrivals since the last good one, and what the latest ones said (a run
        # whose every trajectory fails is stopped by the pipeline: rollart.control.modes)
        self._streak = 0
        self._recent_errors: deque[str] = deque(maxlen=5)
        self._cond: asyncio.Condition | None = None
        self._waiters = 0
        self._soon: asyncio.TimerHandle | None = None  # a journal entry due shortly
        self.ledger = Ledger()
        self.recovered: dict | None = None  # what recover() found
        if recover:
            if self.run_dir is None:
                raise ValueError("SampleBuffer(recover=True) needs the run_dir of the "
                                 "buffer it replaces")
            from rollart.buffer.restore import recover as _recover

            self.recovered = _recover(self)

    # -- internals ----------------------------------------------------------------------
    @property
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: __init__ may run off the event loop
            self._cond = asyncio.Condition()
        return self._cond

    def _buffered(self) -> int:
        return sum(g.rows for g in self._open.values()) + sum(
            g.rows for g in self._complete.values()
        )

    def _leave(self, batches: list[pa.RecordBatch], state: TrajState, step: int | None = None,
               durable: bool = False) -> list[pa.RecordBatch]:
        """Rows that leave the buffer: ledger moves, queued for Parquet (and for the
        journal unless ``durable``: a complete group's rows already are)."""
        out = [restate(b, state.value, step) for b in batches if b.num_rows]
        for traj_id in _ids(out):
            self.ledger.move(traj_id, state.value, step)
        self.store.left(out, durable)
        return out

    def _entry(self) -> asyncio.Future | None:
        """Start the next journal entry (the ledger's changes since the last one)."""
        return self.store.entry(self.ledger.drain(), self._meta())

    def _entry_soon(self) -> None:
        """Journal within ``ENTRY_DELAY`` s: changes that come one trajectory at a time
        (cancellations, failures) share one entry instead of a write each."""
        if self._soon is None and self.store.enabled:
            self._soon = asyncio.get_running_loop().call_later(ENTRY_DELAY, self._entry_now)

    def _entry_now(self) -> None:
        self._soon = None
        self._entry()

    def _meta(self) -> dict:
        return {"counts": dict(self._counts), "ledger": dict(self.ledger.counts),
                "taken": {str(s): t.meta() for s, t in self._taken.items()}}

    def _close_group(self, group: Group) -> None:
        self._open.pop(group.group_id, None)
        self._complete.pop(group.group_id, None)
        self._closed.add(group.group_id)
        self._free(group.group_id)

    def _ignore(self, traj_id: str) -> bool:
        """True for a trajectory already given up as lost (its late arrival is ignored)."""
        if traj_id in self._orphans:
            self._counts["ignored"] += 1
            logger.warning("trajectory %s arrived after it was counted lost; ignored", traj_id)
            return True
        return False

    def _add(self, traj: Trajectory, group_size: int) -> bool:
        """Book one arrival; True when it completed a group with trainable members."""
        if self._ignore(traj.traj_id):
            return False
        self._counts["received"] += 1
        gid = traj.group_id
        failed = _is_failed(traj)
        if failed:
            traj.state = TrajState.FAILED.value
        if gid in self._closed or gid in self._complete:
            logger.warning("late member %s of group %s dropped", traj.traj_id, gid)
            state = TrajState.FAILED if failed else TrajState.DROPPED
            self._leave([to_record_batch([traj])], state)
            return False
        group = self._open.setdefault(gid, Group(gid, max(1, int(group_size))))
        group.arrived += 1
        self._note(traj, failed)
        if failed:
            self._leave([to_record_batch([traj])], TrajState.FAILED)
        else:
            traj.state = BUFFERED
            self.ledger.move(traj.traj_id, BUFFERED)
            group.add(traj)
        if not group.complete:
            return False
        del self._open[gid]
        if not group.rows:  # every member failed (already counted): nothing to train on
            self._closed.add(gid)
            self._free(gid)
            return False
        group.compact()
        self._complete[gid] = group
        self.store.completed(group.arrow())
        return True

    def _note(self, traj: Trajectory, failed: bool) -> None:
        if failed:
            self._streak += 1
            self._recent_errors.append(f"{traj.task} {traj.traj_id}: {traj.error or 'failed'}")
        else:
            self._streak = 0

    def _drop_stale(self, min_version: int) -> int:
        """Drop complete groups older than ``min_version``; returns trajectories dropped."""
        stale = [g for g in self._complete.values() if not within(g.version, min_version)]
        for g in stale:
            self._close_group(g)
            self._leave(g.arrow(), TrajState.DROPPED, durable=True)
        return sum(g.rows for g in stale)

    def _take(self, n_groups: int, step: int | None, min_version: int) -> pa.Table:
        """Hand out the ``n_groups`` oldest complete groups: ``taken`` for ``step``
        (``trained`` at once when there is no step to confirm)."""
        groups = list(self._complete.values())[:n_groups]
        for g in groups:
            self._close_group(g)
        if step is None:
            out = [b for g in groups
                   for b in self._leave(g.arrow(), TrajState.TRAINED, None, durable=True)]
            return pa.Table.from_batches(out, schema=SCHEMA)
        taken = self._taken[step] = Taken(min_version, groups, uuid.uuid4().hex[:12])
        out = [restate(b, TAKEN, step) for g in groups for b in g.arrow()]
        for traj_id in _ids(out):
            self.ledger.move(traj_id, TAKEN, step)
        table = pa.Table.from_batches(out, schema=SCHEMA)
        return table.replace_schema_metadata({**SCHEMA.metadata, TAKE_KEY: taken.take})

    def _counts_now(self) -> dict[str, int]:
        ledger = self.ledger.check()
        return {
            "launched": ledger["launched"],
            **{s: ledger[s] for s in STATES},
            "received": self._counts["received"],
            "groups_complete": len(self._complete),
            "orphaned": self._counts["orphaned"],
            "ignored": self._counts["ignored"],
            "failed_streak": self._streak,  # failed arrivals since the last good one
        }

    def _orphan(self, traj_ids: list[str]) -> None:
        """In-flight trajectories whose worker was lost become failed (``orphaned``)."""
        for t in traj_ids:
            self.ledger.move(t, TrajState.FAILED.value)
        self._orphans.update(traj_ids)
        self.store.orphans.extend(traj_ids)
        self._counts["orphaned"] += len(traj_ids)

    # -- public API ---------------------------------------------------------------------
    async def put(self, traj: Trajectory, group_size: int) -> None:
        """Add one finished trajectory of a group of ``group_size`` members. When it
        completes its group, the group is durable (journaled) before this returns."""
        fut = None
        async with self._condition:
            if self._add(traj, group_size):
                self._condition.notify_all()
                fut = self._entry()
        await self.store.wait(fut)
        await self.store.maybe_flush()

    async def get_batch(
        self,
        n_groups: int,
        min_version: int,
        timeout: float | None = None,
        trained_step: int | None = None,
    ) -> list[Trajectory]:
        """Wait for ``n_groups`` complete groups of version >= ``min_version``; take them.

        Complete groups older than ``min_version`` are dropped on the way. Returns the
        groups' trajectories (oldest completed group first), ``taken`` for step
        ``trained_step`` until ``mark_trained(trained_step)`` (``trained`` at once when
        ``trained_step`` is None). Raises ``TimeoutError`` when ``timeout`` seconds pass.
        """
        return from_table(await self.get_table(n_groups, min_version, timeout, trained_step))

    async def get_table(
        self,
        n_groups: int,
        min_version: int,
        timeout: float | None = None,
        trained_step: int | None = None,
    ) -> pa.Table:
        """``get_batch`` as one Arrow table in ``SCHEMA`` (what the ``Trainer`` pulls:
        Dask sends a table as a few buffers, and turning rows back into records is left
        to the receiving side instead of the buffer's worker, which also runs rollout).
        Batches still taken by earlier steps are settled first (``release_taken``)."""
        if n_groups <= 0:
            return SCHEMA.empty_table()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        cond = self._condition
        async with cond:
            for step in sorted(self._taken):
                self._settle(step, min_version)
            while True:
                floor = self._stale_floor(min_version)  # areal: None (backpressure)
                if floor is not None:
                    self._drop_stale(floor)
                if len(self._complete) >= n_groups:
                    batch = self._take(n_groups, trained_step, min_version)
                    fut = self._entry()
                    break
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"get_batch({n_groups}, min_version={min_version}) timed out after "
                        f"{timeout}s: {len(self._complete)} complete groups ready, "
                        f"counts={self._counts_now()}"
                    )
                self._waiters += 1
                try:
                    await asyncio.wait_for(cond.wait(), remaining)
                except TimeoutError:
                    pass  # loop once more: report or (rarely) succeed
                finally:
                    self._waiters -= 1
        await self.store.wait(fut)  # taken is durable before the trainer sees the batch
        await self.store.maybe_flush()
        return batch

    async def abort_older_than(self, min_version: int) -> int:
        """Drop groups (complete or not) whose arrived members are older than
        ``min_version``; their later members are dropped on arrival. Returns rows dropped."""
        async with self._condition:
            groups = [(g, False) for g in self._open.values()] + \
                     [(g, True) for g in self._complete.values()]
            stale = [(g, done) for g, done in groups if g.rows and not within(g.version, min_version)]
            for g, done in stale:
                self._close_group(g)
                self._leave(g.arrow(), TrajState.DROPPED, durable=done)
            fut = self._entry() if stale else None
        await self.store.wait(fut)
        await self.store.maybe_flush()
        return sum(g.rows for g, _ in stale)

    async def counts(self) -> dict[str, int]:
        """Trajectory counts by state (checked against launches), received, and
        groups_complete. Raises ``AccountingError`` if the ledger does not add up."""
        return self._counts_now()

    async def recent_errors(self) -> list[str]:
        """What the latest failed trajectories said (newest last, at most 5)."""
        return list(self._recent_errors)

    async def launched(self, traj_ids: list[str]) -> None:
        """Record trajectories an env manager has started (durably, before this returns:
        one write per call, and managers launch a group's members in one call)."""
        for t in traj_ids:
            self.ledger.launch(t)
        await self.store.wait(self._entry())

    async def settle(self, traj_ids: list[str], state: str) -> None:
        """Record trajectories that ended outside the buffer (cancelled or aborted)."""
        if state not in (TrajState.CANCELLED.value, TrajState.ABORTED.value):
            raise ValueError(f"settle() takes 'cancelled' or 'aborted', not {state!r}")
        for t in traj_ids:
            if not self._ignore(t):
                self.ledger.move(t, state)
        self._entry_soon()

    async def record_failed(self, traj: Trajectory) -> None:
        """A failed member its env manager replaced: counted and written as ``failed``,
        without taking a place in its group."""
        if self._ignore(traj.traj_id):
            return
        self._counts["received"] += 1
        traj.state = TrajState.FAILED.value
        self._note(traj, True)
        self._leave([to_record_batch([traj])], TrajState.FAILED)
        self._entry_soon()
        await self.store.maybe_flush()

    async def orphan_all_in_flight(self, error: str = "lost with its worker") -> int:
        """End of run, after every live env manager settled its members: whatever the
        ledger still has in flight ran on a manager that was lost; those become
        ``failed`` (counted in ``orphaned``). Returns how many."""
        lost = [t for t, st in self.ledger.state.items() if st == IN_FLIGHT]
        self._orphan(lost)
        if lost:
            logger.warning("%d trajectories were still in flight on lost workers (%s)",
                           len(lost), error)
            await self.store.wait(self._entry())
        return len(lost)

    async def orphan_group(self, group_id: str, error: str = "worker lost") -> dict:
        """A group's env manager was lost: its members still in flight there will never
        arrive, so they become ``failed``. Returns ``{"failed": n, "arrived": k,
        "complete": bool}`` so the driver can restart the ``size - k`` missing members
        elsewhere."""
        prefix = f"{group_id}-"
        lost = [t for t, st in self.ledger.state.items()
                if st == IN_FLIGHT and t.startswith(prefix)]
        self._orphan(lost)
        if lost:
            logger.warning("group %s: %d in-flight members lost with their worker (%s)",
                           group_id, len(lost), error)
            await self.store.wait(self._entry())
        group = self._open.get(group_id)
        done = group_id in self._complete or group_id in self._closed
        return {"failed": len(lost), "arrived": group.arrived if group else 0,
                "complete": done}

    async def size(self) -> int:
        """Trajectories held now (complete and incomplete groups)."""
        return self._buffered()

    async def stats(self) -> dict:
        """``counts()`` plus buffer internals: rows, Arrow bytes, groups, waiters, I/O."""
        groups = list(self._open.values()) + list(self._complete.values())
        return {
            **self._counts_now(),
            "buffered_rows": sum(g.rows for g in groups),
            "arrow_bytes": sum(g.nbytes for g in groups),
            "groups_incomplete": len(self._open),
            "taken_steps": sorted(self._taken),
            "waiters": self._waiters,
            "pending_rows": self.store.pending_rows,
            "parts_started": self.store.parts,
            "journal_entries": self.store.next_entry,
            **await self.slot_stats(),
        }

    async def flush(self) -> int:
        """Journal the ledger, write the rows that left so far, wait for all writes;
        returns parts started."""
        self._entry()
        self.store.write_part()
        await self.store.drain()
        return self.store.parts

    async def snapshot(self, url: str) -> dict:
        """Write the buffer's part of a checkpoint under ``url`` (``rollart.control.checkpoint``;
        see ``rollart.buffer.restore.snapshot``). Returns the manifest entries."""
        from rollart.buffer.restore import snapshot

        return await snapshot(self, url)

    async def restore(self, url: str) -> int:
        """Continue from a snapshot written by ``snapshot`` (see
        ``rollart.buffer.restore.restore``). Returns rows buffered."""
        from rollart.buffer.restore import restore

        return await restore(self, url)

    async def close(self) -> None:
        """Flush and release the I/O thread. Batches still taken (their step neither
        confirmed nor settled) leave as ``lost_in_step``; buffered rows stay buffered
        (in the journal: ``read_samples`` shows them)."""
        self._stop_slots()
        async with self._condition:
            for step in sorted(self._taken):
                self._confirm(step, TrajState.LOST_IN_STEP)
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        await self.flush()
        self.store.close()
