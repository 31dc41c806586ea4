"""``BufferStore``: the ``SampleBuffer``'s durable store: the ``samples/`` part files and the
one thread every file of the buffer is written on, in the order started (so no write
blocks the worker's event loop).

Consumes the rows that leave the buffer (``left``); produces the
``samples/part-*.parquet`` parts (``flush_every`` rows each, layout in
``rollart.buffer.journal``). The buffer's ``Journal`` writes its entries through
``submit`` too, so an entry and a part are written in the order they were started. A
part that fails is logged and its rows are kept for the next one. Held by
``rollart.buffer.buffer.SampleBuffer``; with ``run_dir=None`` nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from rollart.buffer.schema import SCHEMA, write_parquet

logger = logging.getLogger(__name__)


class BufferStore:
    """Part files of one buffer and its I/O thread (module docstring)."""

    def __init__(self, run_dir: str | None, flush_every: int = 256):
        self.run_dir = run_dir
        self.flush_every = max(1, int(flush_every))
        self.pending: list[pa.RecordBatch] = []  # left the buffer, not yet in a part
        self.pending_rows = 0
        self.parts = 0  # next part index
        self.writes: set[asyncio.Future] = set()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None

    def left(self, batches: list[pa.RecordBatch]) -> None:
        """Rows that left the buffer (final state): queued for the next part."""
        if not self.enabled:
            return
        self.pending.extend(batches)
        self.pending_rows += sum(b.num_rows for b in batches)

    def submit(self, fn, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on the I/O thread, after every write started before."""
        if self._pool is None:  # one thread: files are written in the order started
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sample-buffer-io")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        self.writes.add(fut)
        fut.add_done_callback(self.writes.discard)
        return fut

    def write_part(self) -> asyncio.Future | None:
        """Start writing the rows that left as the next part file."""
        if not self.enabled or not self.pending_rows:
            return None
        table = pa.Table.from_batches(self.pending, schema=SCHEMA)
        url = f"{self.run_dir}/samples/part-{self.parts:05d}.parquet"
        self.parts += 1
        self.pending, self.pending_rows = [], 0
        fut = self.submit(write_parquet, table, url)
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
