"""``BufferStore``: what the ``SampleBuffer`` writes under its run dir, in order, on one
thread of its own (so no write blocks the worker's event loop).

Consumes the rows that leave the buffer (``left``), the rows of groups that complete
(``completed``) and the ledger's drained changes (``entry``); produces the
``samples/part-*.parquet`` parts (``flush_every`` rows each) and the journal entries
(``pending/`` + ``ledger/``) described in ``rollart.buffer.journal``. A write that fails
is logged and its contents are kept for the next one. Used by
``rollart.buffer.buffer`` only; with ``run_dir=None`` nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from rollart.buffer import journal
from rollart.buffer.schema import SCHEMA, write_parquet

logger = logging.getLogger(__name__)


class BufferStore:
    """Part files and journal entries of one buffer, written in the order started."""

    def __init__(self, run_dir: str | None, flush_every: int = 256):
        self.run_dir = run_dir
        self.flush_every = max(1, int(flush_every))
        self.pending: list[pa.RecordBatch] = []  # left the buffer, not yet in a part
        self.pending_rows = 0
        self.parts = 0  # next part index
        self.rows: list[pa.RecordBatch] = []  # for the next journal entry's pending/ file
        self.backlog: list[tuple] = []  # changes of a journal entry whose write failed
        self.orphans: list[str] = []  # ids orphaned since the last entry
        self.next_entry = 0
        self.writes: set[asyncio.Future] = set()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None

    # -- what to write --------------------------------------------------------------------
    def left(self, batches: list[pa.RecordBatch], durable: bool) -> None:
        """Rows that left the buffer (final state): queued for a part, and for the next
        journal entry unless ``durable`` (already journaled, as a complete group was)."""
        if not self.enabled:
            return
        self.pending.extend(batches)
        self.pending_rows += sum(b.num_rows for b in batches)
        if not durable:
            self.rows.extend(batches)

    def completed(self, batches: list[pa.RecordBatch]) -> None:
        """A complete group's rows, for the next journal entry."""
        if self.enabled:
            self.rows.extend(batches)

    # -- writing --------------------------------------------------------------------------
    def _submit(self, fn, *args) -> asyncio.Future:
        if self._pool is None:  # one thread: files are written in the order started
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sample-buffer-io")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        self.writes.add(fut)
        fut.add_done_callback(self.writes.discard)
        return fut

    def _take_entry(self, changes: list[tuple], meta: dict):
        n, self.next_entry = self.next_entry, self.next_entry + 1
        changes = self.backlog + changes
        rows = pa.Table.from_batches(self.rows, schema=SCHEMA) if self.rows else None
        meta = {**meta, "orphans": self.orphans, "next_part": self.parts}
        self.rows, self.backlog, self.orphans = [], [], []
        return n, rows, changes, meta

    def entry(self, changes: list[tuple], meta: dict) -> asyncio.Future | None:
        """Start writing the next journal entry: the queued rows, ``changes`` (ledger
        ``(traj_id, state, step)``) and ``meta``. None when there is nothing to write."""
        if not self.enabled or not (changes or self.rows or self.backlog or self.orphans):
            return None
        n, rows, changes, meta = self._take_entry(changes, meta)
        fut = self._submit(journal.write_entry, self.run_dir, n, rows, changes, meta)
        fut.add_done_callback(lambda f: self._entry_done(f, n, rows, changes, meta))
        return fut

    def entry_now(self, changes: list[tuple], meta: dict) -> None:
        """``entry``, written in the calling thread (a constructor, no event loop)."""
        if self.enabled and (changes or self.rows or self.orphans):
            journal.write_entry(self.run_dir, *self._take_entry(changes, meta))

    def _entry_done(self, fut, n, rows, changes, meta) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        logger.error("writing journal entry %d under %s failed (%r): its changes are not "
                     "durable yet and go into the next entry", n, self.run_dir,
                     fut.exception())
        self.backlog[:0] = changes
        self.orphans[:0] = meta.get("orphans", [])
        if rows is not None:
            self.rows[:0] = rows.to_batches()

    def write_part(self) -> asyncio.Future | None:
        """Start writing the rows that left as the next part file."""
        if not self.enabled or not self.pending_rows:
            return None
        table = pa.Table.from_batches(self.pending, schema=SCHEMA)
        url = f"{self.run_dir}/samples/part-{self.parts:05d}.parquet"
        self.parts += 1
        self.pending, self.pending_rows = [], 0
        fut = self._submit(write_parquet, table, url)
        fut.add_done_callback(lambda f: self._part_done(f, table, url))
        return fut

    def _part_done(self, fut: asyncio.Future, table: pa.Table, url: str) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            logger.error("writing %s failed (%r); rows kept for the next flush",
                         url, fut.exception())
            self.pending[:0] = table.to_batches()
            self.pending_rows += table.num_rows

    @staticmethod
    async def wait(fut: asyncio.Future | None) -> None:
        """Wait for ``fut`` (errors are logged by its callback, not raised)."""
        if fut is not None:
            await asyncio.wait([fut])

    async def maybe_flush(self) -> None:
        """Write a part once ``flush_every`` rows wait."""
        if self.pending_rows >= self.flush_every:
            await self.wait(self.write_part())

    async def drain(self) -> None:
        """Wait for every write started so far."""
        if self.writes:
            await asyncio.wait(list(self.writes))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
