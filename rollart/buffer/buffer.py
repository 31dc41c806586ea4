"""``SampleBuffer``: a Dask actor that turns finished trajectories into GRPO batches.

Consumes ``Trajectory`` records one at a time (``put``, called by the rollout side) and
hands out complete, bounded-stale groups to the ``Trainer`` (``get_table``: one Arrow
table; ``get_batch``: the same as records). Buffered rows are held as Arrow record
batches in ``rollart.buffer.schema.SCHEMA``, one per group once it completes. Every
trajectory that leaves (trained, dropped, failed) is written, when ``run_dir`` is set,
to ``{run_dir}/samples/part-{k:05d}.parquet`` with its final ``state`` and
``trained_step``. Invariant: received == buffered + trained + dropped + failed. The
buffer also keeps the run's ``Ledger`` (``rollart.buffer.ledger``): managers report
launches, cancellations and aborts here, so one actor holds every trajectory's state.
All public methods are coroutines that run on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from rollart.buffer.ledger import Ledger
from rollart.buffer.group import Group, restate
from rollart.buffer.schema import SCHEMA, from_table, to_record_batch, write_parquet
from rollart.types import Trajectory, TrajState

logger = logging.getLogger(__name__)

def _is_failed(traj: Trajectory) -> bool:
    failed = TrajState.FAILED.value
    return getattr(traj.state, "value", traj.state) == failed or traj.outcome == failed


class SampleBuffer:
    """Groups trajectories by ``group_id`` and serves bounded-stale GRPO batches.

    Use as a Dask actor: ``client.submit(SampleBuffer, run_dir, actor=True)``.
    """

    def __init__(self, run_dir: str | None = None, *, flush_every: int = 256):
        self.run_dir = str(run_dir).rstrip("/") if run_dir is not None else None
        self.flush_every = max(1, int(flush_every))
        self._open: dict[str, Group] = {}  # incomplete groups
        self._complete: OrderedDict[str, Group] = OrderedDict()  # FIFO by completion
        self._closed: set[str] = set()  # groups that left; late members are dropped
        self._counts = dict(received=0, trained=0, dropped=0, failed=0)
        # failed arrivals since the last good one, and what the latest ones said (a run
        # whose every trajectory fails is stopped by the pipeline: rollart.pipeline)
        self._streak = 0
        self._recent_errors: deque[str] = deque(maxlen=5)
        self._cond: asyncio.Condition | None = None
        self._waiters = 0
        self._pending: list[pa.RecordBatch] = []  # left the buffer, not yet written
        self._pending_rows = 0
        self._parts = 0  # next part index
        self._writes: set[asyncio.Future] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.ledger = Ledger()

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

    def _leave(self, batches: list[pa.RecordBatch], state: TrajState, step: int | None = None):
        """Count rows that leave the buffer and queue them for Parquet."""
        key = {TrajState.TRAINED: "trained", TrajState.FAILED: "failed"}.get(state, "dropped")
        out = [restate(b, state.value, step) for b in batches if b.num_rows]
        for b in out:
            for traj_id in b.column("traj_id").to_pylist():
                self.ledger.move(traj_id, state.value)
        rows = sum(b.num_rows for b in out)
        self._counts[key] += rows
        if self.run_dir is not None:
            self._pending.extend(out)
            self._pending_rows += rows
        return out

    def _close_group(self, group: Group) -> None:
        self._open.pop(group.group_id, None)
        self._complete.pop(group.group_id, None)
        self._closed.add(group.group_id)

    def _add(self, traj: Trajectory, group_size: int) -> bool:
        """Book one arrival; True when it completed a group with trainable members."""
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
            traj.state = TrajState.BUFFERED.value
            self.ledger.move(traj.traj_id, TrajState.BUFFERED.value)
            group.add(traj)
        if not group.complete:
            return False
        del self._open[gid]
        if not group.rows:  # every member failed (already counted): nothing to train on
            self._closed.add(gid)
            return False
        group.compact()
        self._complete[gid] = group
        return True

    def _note(self, traj: Trajectory, failed: bool) -> None:
        if failed:
            self._streak += 1
            self._recent_errors.append(f"{traj.task} {traj.traj_id}: {traj.error or 'failed'}")
        else:
            self._streak = 0

    def _drop_stale(self, min_version: int) -> int:
        """Drop complete groups older than ``min_version``; returns trajectories dropped."""
        stale = [g for g in self._complete.values() if g.version < min_version]
        for g in stale:
            self._close_group(g)
            self._leave(g.arrow(), TrajState.DROPPED)
        return sum(g.rows for g in stale)

    def _take(self, n_groups: int, trained_step: int | None) -> pa.Table:
        """Hand out the ``n_groups`` oldest complete groups."""
        groups = list(self._complete.values())[:n_groups]
        out: list[pa.RecordBatch] = []
        for g in groups:
            self._close_group(g)
            out.extend(self._leave(g.arrow(), TrajState.TRAINED, trained_step))
        return pa.Table.from_batches(out, schema=SCHEMA)

    def _counts_now(self) -> dict[str, int]:
        c = self._counts
        ledger = self.ledger.check()
        return {
            "launched": ledger["launched"],
            "in_flight": ledger["in_flight"],
            "aborted": ledger["aborted"],
            "cancelled": ledger["cancelled"],
            "received": c["received"],
            "buffered": self._buffered(),
            "trained": c["trained"],
            "dropped": c["dropped"],
            "failed": c["failed"],
            "groups_complete": len(self._complete),
            "orphaned": c.get("orphaned", 0),
            "failed_streak": self._streak,  # failed arrivals since the last good one
        }

    # -- persistence --------------------------------------------------------------------
    def _write_part(self) -> asyncio.Future | None:
        """Start writing the pending rows as the next part file (in a worker thread)."""
        if self.run_dir is None or not self._pending_rows:
            return None
        table = pa.Table.from_batches(self._pending, schema=SCHEMA)
        url = f"{self.run_dir}/samples/part-{self._parts:05d}.parquet"
        self._parts += 1
        self._pending, self._pending_rows = [], 0
        if self._pool is None:  # one thread: part files are written in order
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sample-buffer-io")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, write_parquet, table, url)
        self._writes.add(fut)
        fut.add_done_callback(lambda f: self._write_done(f, table, url))
        return fut

    def _write_done(self, fut: asyncio.Future, table: pa.Table, url: str) -> None:
        self._writes.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            logger.error("writing %s failed (%r); rows kept for the next flush",
                         url, fut.exception())
            self._pending[:0] = table.to_batches()
            self._pending_rows += table.num_rows

    async def _maybe_flush(self) -> None:
        """Write a part once ``flush_every`` rows wait; errors are logged, not raised."""
        if self._pending_rows >= self.flush_every:
            fut = self._write_part()
            if fut is not None:
                await asyncio.wait([fut])

    # -- public API ---------------------------------------------------------------------
    async def put(self, traj: Trajectory, group_size: int) -> None:
        """Add one finished trajectory of a group of ``group_size`` members."""
        async with self._condition:
            if self._add(traj, group_size):
                self._condition.notify_all()
        await self._maybe_flush()

    async def get_batch(
        self,
        n_groups: int,
        min_version: int,
        timeout: float | None = None,
        trained_step: int | None = None,
    ) -> list[Trajectory]:
        """Wait for ``n_groups`` complete groups of version >= ``min_version``; take them.

        Complete groups older than ``min_version`` are dropped on the way. Returns the
        groups' trajectories (oldest completed group first) marked ``trained``.
        Raises ``TimeoutError`` when ``timeout`` seconds pass first.
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
        to the receiving side instead of the buffer's worker, which also runs rollout)."""
        if n_groups <= 0:
            return SCHEMA.empty_table()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        cond = self._condition
        async with cond:
            while True:
                self._drop_stale(min_version)
                if len(self._complete) >= n_groups:
                    batch = self._take(n_groups, trained_step)
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
        await self._maybe_flush()
        return batch

    async def abort_older_than(self, min_version: int) -> int:
        """Drop groups (complete or not) whose arrived members are older than
        ``min_version``; their later members are dropped on arrival. Returns rows dropped."""
        async with self._condition:
            groups = list(self._open.values()) + list(self._complete.values())
            stale = [g for g in groups if g.rows and g.version < min_version]
            for g in stale:
                self._close_group(g)
                self._leave(g.arrow(), TrajState.DROPPED)
        await self._maybe_flush()
        return sum(g.rows for g in stale)

    async def counts(self) -> dict[str, int]:
        """Trajectory counts by state (checked against launches), received, and
        groups_complete. Raises ``AccountingError`` if the ledger does not add up."""
        return self._counts_now()

    async def recent_errors(self) -> list[str]:
        """What the latest failed trajectories said (newest last, at most 5)."""
        return list(self._recent_errors)

    async def launched(self, traj_ids: list[str]) -> None:
        """Record trajectories an env manager has started."""
        for t in traj_ids:
            self.ledger.launch(t)

    async def settle(self, traj_ids: list[str], state: str) -> None:
        """Record trajectories that ended outside the buffer (cancelled or aborted)."""
        if state not in (TrajState.CANCELLED.value, TrajState.ABORTED.value):
            raise ValueError(f"settle() takes 'cancelled' or 'aborted', not {state!r}")
        for t in traj_ids:
            self.ledger.move(t, state)

    async def record_failed(self, traj: Trajectory) -> None:
        """A failed member its env manager replaced: counted and written as ``failed``,
        without taking a place in its group."""
        self._counts["received"] += 1
        traj.state = TrajState.FAILED.value
        self._note(traj, True)
        self._leave([to_record_batch([traj])], TrajState.FAILED)
        await self._maybe_flush()

    async def orphan_all_in_flight(self, error: str = "lost with its worker") -> int:
        """End of run, after every live env manager settled its members: whatever the
        ledger still has in flight ran on a manager that was lost; those become
        ``failed`` (counted in ``orphaned``). Returns how many."""
        lost = [t for t, st in self.ledger.state.items() if st == "in_flight"]
        for t in lost:
            self.ledger.move(t, TrajState.FAILED.value)
        self._counts["failed"] += len(lost)
        self._counts["orphaned"] = self._counts.get("orphaned", 0) + len(lost)
        if lost:
            logger.warning("%d trajectories were still in flight on lost workers (%s)",
                           len(lost), error)
        return len(lost)

    async def orphan_group(self, group_id: str, error: str = "worker lost") -> dict:
        """A group's env manager was lost: its members still in flight there will never
        arrive, so they become ``failed``. Returns ``{"failed": n, "arrived": k,
        "complete": bool}`` so the driver can restart the ``size - k`` missing members
        elsewhere."""
        prefix = f"{group_id}-"
        lost = [t for t, st in self.ledger.state.items()
                if st == "in_flight" and t.startswith(prefix)]
        for t in lost:
            self.ledger.move(t, TrajState.FAILED.value)
        self._counts["failed"] += len(lost)
        self._counts["orphaned"] = self._counts.get("orphaned", 0) + len(lost)
        if lost:
            logger.warning("group %s: %d in-flight members lost with their worker (%s)",
                           group_id, len(lost), error)
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
            "waiters": self._waiters,
            "pending_rows": self._pending_rows,
            "parts_started": self._parts,
        }

    async def flush(self) -> int:
        """Write the rows that left so far, wait for all writes; returns parts started."""
        self._write_part()
        if self._writes:
            await asyncio.gather(*list(self._writes))
        return self._parts

    async def snapshot(self, url: str) -> dict:
        """Write the buffer's part of a checkpoint under ``url`` (``rollart.checkpoint``):
        every buffered row as ``buffer.parquet`` and its bookkeeping as ``buffer.json``.

        Rows that already left are flushed to ``samples/`` first, so the checkpoint's
        ``next_part`` marks exactly which part files belong to the checkpointed run.
        Returns the manifest entries."""
        import io
        import json

        import pyarrow.parquet as pq

        from rollart.checkpoint import write_bytes

        async with self._condition:
            await self.flush()
            groups = [(g, True) for g in self._complete.values()] + \
                     [(g, False) for g in self._open.values()]
            batches = [b for g, _ in groups for b in g.arrow()]
            meta = {
                "counts": dict(self._counts), "ledger": dict(self.ledger.counts),
                "next_part": self._parts,
                "groups": [{"id": g.group_id, "size": g.size, "arrived": g.arrived,
                            "rows": g.rows, "complete": done} for g, done in groups],
            }
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_batches(batches, schema=SCHEMA), buf)
        files = write_bytes(url, "buffer.parquet", buf.getvalue())
        files.update(write_bytes(url, "buffer.json", json.dumps(meta, indent=1).encode()))
        return files

    async def restore(self, url: str) -> int:
        """Continue from a snapshot written by ``snapshot``: counts, ledger totals and
        the Parquet part counter continue; complete groups are buffered again (in their
        order); incomplete ones can never complete (their missing members died with the
        old run), so their rows are dropped. Trajectories in flight at the snapshot
        count as aborted. Part files the old run wrote after the snapshot are moved to
        ``samples/after-resume-{k}/`` so no trajectory appears trained twice. Returns
        rows buffered."""
        import io
        import json

        import fsspec
        import pyarrow.parquet as pq

        fs, root = fsspec.core.url_to_fs(str(url))
        root = root.rstrip("/")
        with fs.open(f"{root}/buffer.json", "r") as f:
            meta = json.load(f)
        with fs.open(f"{root}/buffer.parquet", "rb") as f:
            table = pq.read_table(io.BytesIO(f.read())).cast(SCHEMA)
        async with self._condition:
            self._counts = dict(meta["counts"])
            ledger = dict(meta["ledger"])
            ledger["aborted"] = ledger.get("aborted", 0) + ledger.pop("in_flight", 0)
            self.ledger.counts.clear()
            self.ledger.counts.update(ledger)
            self._parts = int(meta["next_part"])
            self._set_aside_parts_after(self._parts)
            ids = table.column("group_id").to_pylist()
            rows_by_group: dict[str, list[int]] = {}
            for i, gid in enumerate(ids):
                rows_by_group.setdefault(gid, []).append(i)
            for info in meta["groups"]:
                idx = rows_by_group.get(info["id"], [])
                part = table.take(idx).combine_chunks()
                group = Group(info["id"], info["size"], arrived=info["arrived"],
                               batches=part.to_batches(),
                               versions=part.column("version").to_pylist())
                for traj_id in part.column("traj_id").to_pylist():
                    self.ledger.state[traj_id] = TrajState.BUFFERED.value
                if info["complete"]:
                    self._complete[group.group_id] = group
                else:
                    self._closed.add(group.group_id)
                    self._leave(group.arrow(), TrajState.DROPPED)
            self.ledger.check()
            self._condition.notify_all()
        await self.flush()
        return self._buffered()

    def _set_aside_parts_after(self, next_part: int) -> None:
        if self.run_dir is None:
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(f"{self.run_dir}/samples")
        if not fs.exists(root):
            return
        later = [p for p in fs.glob(f"{root}/part-*.parquet")
                 if int(p.rsplit("-", 1)[-1].split(".")[0]) >= next_part]
        if later:
            k = len(fs.glob(f"{root}/after-resume-*"))
            fs.makedirs(f"{root}/after-resume-{k}", exist_ok=True)
            for p in later:
                fs.mv(p, f"{root}/after-resume-{k}/{p.rsplit('/', 1)[-1]}")

    async def close(self) -> None:
        """Flush and release the I/O thread. Still-buffered rows are not written."""
        await self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
