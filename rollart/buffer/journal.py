"""The sample buffer's durable record under its run dir: ``Journal``, the buffer's part that
writes it, and ``read_samples`` over it.

Written by ``Journal`` (held by ``rollart.buffer.buffer.SampleBuffer``; its files go
through the buffer's ``BufferStore`` I/O thread, ``rollart.buffer.store``); read back by a
recovering buffer (``SampleBuffer(run_dir, recover=True)``, ``rollart.buffer.restore``)
and by anything that analyses a run (``read_samples``: ``rollart.app.api``, tests,
``benchmarks/chaos.py``). Every path is an fsspec URL (local, ``memory://``, ...)::

    samples/part-{k:05d}.parquet  rows that LEFT the buffer (trained, dropped, failed,
                                  lost_in_step) in ``SCHEMA`` with their final ``state``
                                  and ``trained_step``, ``flush_every`` rows a part
    pending/{n:08d}.parquet       journal entry n's rows (``SCHEMA``), each trajectory
                                  once, with the state it had then: the members of each
                                  group that completed since entry n-1 (``buffered``) and
                                  rows that left outside a complete group (failed
                                  arrivals, late members)
    ledger/{n:08d}.parquet        journal entry n's ledger changes, oldest first:
                                  ``traj_id, state, trained_step``; its schema metadata
                                  ``rollart_buffer`` (JSON) holds the buffer's counters,
                                  ledger totals, the steps whose batch is ``taken`` (with
                                  the ``min_version`` they were taken for), ids orphaned
                                  in that entry, and the next part number

How a reader combines them (``read_samples``): the rows of the ``samples/`` parts, then
the ``pending/`` rows of every trajectory not in a part, with ``state`` and
``trained_step`` from its latest ``ledger/`` record. A trajectory's latest state is its
last ledger record in entry order. An entry is written, and awaited, when an env
manager reports launches (one call per group), when a group completes, when the trainer
takes a batch, confirms or releases it, when stale groups are aborted, and at
flush/snapshot; cancellations and failures are journaled within ``ENTRY_DELAY`` (50 ms)
of each other; arrivals into a group still open wait for the next entry (until their
group completes they are not durable: a recovered buffer counts them as lost). An entry
is made by its ``ledger/`` file, written after its ``pending/`` rows: rows whose ledger
file is missing or unreadable (a crash between the two, or one cut short, skipped with a
warning) belong to an entry never made, and every reader ignores them; a recovering
buffer moves those of a missing entry to ``pending/uncommitted-{k}/`` before it writes
that entry number again.
Folders ``*/after-resume-{k}/`` hold what a run lost after the checkpoint it was resumed
from (``rollart.control.checkpoint``); readers ignore them.

Compaction (``compact``, at each checkpoint's snapshot, on the buffer's I/O thread after
every entry before it is written): the entries written since the previous compaction
become one, numbered like the last of them (its ``ledger/`` changes in entry order, its
``pending/`` rows in entry order, the last metadata with every orphan), so a long run
keeps one pair of journal files per checkpoint interval. Replaying it gives the same
state as replaying the entries it replaces, and a crash midway leaves both (replayed
twice, same result). Compacted ranges never cross a checkpoint's ``next_entry``, so a
resume still sets aside exactly the lost run's later entries.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollart.buffer.schema import SCHEMA, conform, read_parts

logger = logging.getLogger(__name__)

LEDGER_SCHEMA = pa.schema([("traj_id", pa.string()), ("state", pa.string()),
                           ("trained_step", pa.int32())])
META_KEY = b"rollart_buffer"
ENTRY_DELAY = 0.05  # s: the longest a cancellation or failure waits for the journal
_STATE = SCHEMA.get_field_index("state")
_STEP = SCHEMA.get_field_index("trained_step")


def _fs(run_dir: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(str(run_dir))
    return fs, root.rstrip("/")


def _write(fs, path: str, table: pa.Table) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)


def write_entry(run_dir: str, n: int, rows: pa.Table | None,
                changes: list[tuple[str, str, int | None]], meta: dict) -> None:
    """Write journal entry ``n``: its rows (if any), then its ledger changes + ``meta``."""
    fs, root = _fs(run_dir)
    if rows is not None and rows.num_rows:
        _write(fs, f"{root}/pending/{n:08d}.parquet", rows)
    ids, states, steps = zip(*changes) if changes else ((), (), ())
    table = pa.table([pa.array(ids, pa.string()), pa.array(states, pa.string()),
                      pa.array(steps, pa.int32())], schema=LEDGER_SCHEMA)
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    _write(fs, f"{root}/ledger/{n:08d}.parquet", table)


def entries(run_dir: str, kind: str) -> list[tuple[int, str]]:
    """``(n, path)`` of the journal files in ``kind`` (``ledger`` or ``pending``)."""
    fs, root = _fs(run_dir)
    out = []
    for p in fs.glob(f"{root}/{kind}/*.parquet"):
        name = p.rsplit("/", 1)[-1][:-len(".parquet")]
        if name.isdigit():
            out.append((int(name), p))
    return sorted(out)


def _read(fs, path: str) -> pa.Table | None:
    try:
        with fs.open(path, "rb") as f:
            return pq.read_table(f)
    except Exception as e:  # noqa: BLE001 - a file a crash cut short: skip it, say so
        logger.warning("skipping unreadable journal file %s (%r)", path, e)
        return None


@dataclass
class LedgerRecord:
    """The journal replayed: each trajectory's latest ``(state, trained_step)``, the
    newest entry's metadata, all orphaned ids, the next entry number and the entries
    made (their ledger file readable: only their ``pending/`` rows count)."""

    latest: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    meta: dict | None = None
    orphans: set[str] = field(default_factory=set)
    next_entry: int = 0
    made: set[int] = field(default_factory=set)


def read_ledger(run_dir: str) -> LedgerRecord:
    """Replay ``ledger/`` in entry order."""
    fs, _ = _fs(run_dir)
    rec = LedgerRecord()
    for n, path in entries(run_dir, "ledger"):
        rec.next_entry = n + 1
        table = _read(fs, path)
        if table is None:
            continue
        rec.made.add(n)
        cols = [table.column(c).to_pylist() for c in LEDGER_SCHEMA.names]
        rec.latest.update((t, (s, k)) for t, s, k in zip(*cols))
        meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"null"))
        if meta is not None:
            rec.meta = meta
            rec.orphans.update(meta.get("orphans", ()))
    return rec


def read_pending(run_dir: str, made: set[int], ids: set[str] | None = None) -> pa.Table:
    """The ``pending/`` rows of the entries ``made`` (``LedgerRecord.made``; of ``ids``
    only, if given) in entry order, in ``SCHEMA``."""
    fs, _ = _fs(run_dir)
    tables = []
    for n, path in entries(run_dir, "pending"):
        if n not in made:  # its ledger file is missing or unreadable: never made
            continue
        t = _read(fs, path)
        if t is None:
            continue
        t = conform(t)
        if ids is not None:
            t = t.filter(pc.is_in(t.column("traj_id"), pa.array(list(ids), pa.string())))
        tables.append(t)
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def with_latest(rows: pa.Table, latest: dict[str, tuple[str, int | None]]) -> pa.Table:
    """``rows`` with ``state`` and ``trained_step`` set from ``latest`` (where listed)."""
    ids = rows.column("traj_id").to_pylist()
    old_s, old_k = rows.column("state").to_pylist(), rows.column("trained_step").to_pylist()
    states = [latest[t][0] if t in latest else s for t, s in zip(ids, old_s)]
    steps = [latest[t][1] if t in latest else k for t, k in zip(ids, old_k)]
    rows = rows.set_column(_STATE, SCHEMA.field(_STATE), pa.array(states, pa.string()))
    return rows.set_column(_STEP, SCHEMA.field(_STEP), pa.array(steps, pa.int32()))


def unwritten(pending: pa.Table, parts: pa.Table,
              latest: dict[str, tuple[str, int | None]]) -> pa.Table:
    """The journal's ``pending`` rows of trajectories that are in no part of ``parts``,
    each once (its latest row), with its latest state."""
    if not pending.num_rows:
        return pending
    written = set(parts.column("traj_id").to_pylist())
    ids = pending.column("traj_id").to_pylist()
    last = {t: i for i, t in enumerate(ids)}  # a row rewritten later wins
    keep = [i for i, t in enumerate(ids) if t not in written and last[t] == i]
    return with_latest(pending.take(pa.array(keep, pa.int64())), latest)


def read_samples(run_dir_or_url: str) -> pa.Table:
    """The latest state of every trajectory row of a run, as one table in ``SCHEMA``.

    For a run dir: the rows of ``samples/*.parquet`` (in the order written), then rows
    only the journal has (``pending/`` + ``ledger/``: still buffered or taken, or left
    but not yet in a part when the buffer's worker was lost). Given a samples folder or
    one Parquet file: just those rows. An empty table when there is nothing yet.
    """
    parts = read_parts(run_dir_or_url)
    fs, root = _fs(run_dir_or_url)
    if root.endswith(".parquet") or not fs.isdir(f"{root}/ledger"):
        return parts
    record = read_ledger(run_dir_or_url)
    extra = unwritten(read_pending(run_dir_or_url, record.made), parts, record.latest)
    return pa.concat_tables([parts, extra]) if extra.num_rows else parts


def set_aside(run_dir: str, first_entry: int, folder: str = "after-resume") -> int:
    """Move journal entries ``>= first_entry`` to ``{kind}/{folder}-{k}/``: a lost run's,
    after the checkpoint a run resumes from, or (``folder="uncommitted"``) the rows of an
    entry a lost buffer never made, before its recovered buffer writes that number
    again. Returns how many files moved."""
    fs, root = _fs(run_dir)
    moved = 0
    for kind in ("ledger", "pending"):
        later = [p for n, p in entries(run_dir, kind) if n >= first_entry]
        if not later:
            continue
        k = len(fs.glob(f"{root}/{kind}/{folder}-*"))
        fs.makedirs(f"{root}/{kind}/{folder}-{k}", exist_ok=True)
        for p in later:
            fs.mv(p, f"{root}/{kind}/{folder}-{k}/{p.rsplit('/', 1)[-1]}")
            moved += 1
    return moved


def _meta(table: pa.Table) -> dict | None:
    return json.loads((table.schema.metadata or {}).get(META_KEY, b"null"))


def compact(run_dir: str, upto: int) -> int:
    """Merge the journal entries ``< upto`` written since the last compaction into one,
    numbered like the last of them; returns how many files it removed. Every entry
    ``< upto`` must be on disk (the buffer's I/O thread runs this after their writes)."""
    fs, root = _fs(run_dir)
    run: list[tuple[int, str, pa.Table | None]] = []
    for n, path in reversed([e for e in entries(run_dir, "ledger") if e[0] < upto]):
        table = _read(fs, path)
        if table is not None and (_meta(table) or {}).get("compacted"):
            break  # the previous compaction's: the run starts after it
        run.append((n, path, table))
    run.reverse()
    if len(run) < 2:
        return 0
    first, last = run[0][0], run[-1][0]
    readable = [t for _, _, t in run if t is not None]  # unreadable: never made
    metas = [m for m in map(_meta, readable) if m is not None]
    meta = {**(metas[-1] if metas else {}), "compacted": [first, last],
            "orphans": sorted({o for m in metas for o in m.get("orphans", ())})}
    changes = pa.concat_tables([t.select(LEDGER_SCHEMA.names).cast(LEDGER_SCHEMA)
                                .replace_schema_metadata(None) for t in readable])
    made = {n for n, _, t in run if t is not None}
    pending = [(n, p) for n, p in entries(run_dir, "pending") if first <= n <= last]
    rows = [conform(t) for t in (_read(fs, p) for n, p in pending if n in made)
            if t is not None]
    # the merged files replace entry ``last`` (a rename), then the others go
    if rows:
        _replace(fs, f"{root}/pending/{last:08d}.parquet", pa.concat_tables(rows))
    elif last in dict(pending):  # rows of an entry never made: not the merged entry's
        fs.rm(dict(pending)[last])
    _replace(fs, f"{root}/ledger/{last:08d}.parquet",
             changes.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}))
    old = [p for n, p, _ in run if n != last] + [p for n, p in pending if n != last]
    for p in old:
        fs.rm(p)
    return len(old)


def _replace(fs, path: str, table: pa.Table) -> None:
    tmp = f"{path}.tmp"  # not ``*.parquet``: ``entries`` never lists it
    _write(fs, tmp, table)
    fs.mv(tmp, path)


# -- the writer: the buffer's part -----------------------------------------------------
class Journal:
    """The journal entries of one buffer: the rows queued for the next entry's
    ``pending/`` file, the ids orphaned since the last entry, the changes of an entry
    whose write failed (they go into the next), and the next entry number. Entries are
    written on ``store``'s I/O thread (a ``BufferStore``: its ``parts`` counter is
    recorded in each entry); with ``run_dir=None`` nothing is.

    >>> j = Journal(None, store=None)
    >>> j.add_rows([]); j.entry([("t-0", "in_flight", None)], {}) is None
    True
    """

    def __init__(self, run_dir: str | None, store):
        self.run_dir = run_dir
        self.store = store
        self.rows: list[pa.RecordBatch] = []  # for the next entry's pending/ file
        self.backlog: list[tuple] = []  # changes of an entry whose write failed
        self.orphans: list[str] = []  # ids orphaned since the last entry
        self.next_entry = 0
        self._soon: asyncio.TimerHandle | None = None  # an entry due shortly

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None

    def add_rows(self, batches: list[pa.RecordBatch]) -> None:
        """Rows for the next entry: a complete group's, or rows that left outside one."""
        if self.enabled:
            self.rows.extend(batches)

    def orphaned(self, traj_ids: list[str]) -> None:
        if self.enabled:
            self.orphans.extend(traj_ids)

    def _take_entry(self, changes: list[tuple], meta: dict):
        n, self.next_entry = self.next_entry, self.next_entry + 1
        changes = self.backlog + changes
        rows = pa.Table.from_batches(self.rows, schema=SCHEMA) if self.rows else None
        meta = {**meta, "orphans": self.orphans, "next_part": self.store.parts}
        self.rows, self.backlog, self.orphans = [], [], []
        return n, rows, changes, meta

    def entry(self, changes: list[tuple], meta: dict) -> asyncio.Future | None:
        """Start writing the next entry: the queued rows, ``changes`` (ledger
        ``(traj_id, state, step)``) and ``meta``. None when there is nothing to write."""
        if not self.enabled or not (changes or self.rows or self.backlog or self.orphans):
            return None
        n, rows, changes, meta = self._take_entry(changes, meta)
        fut = self.store.submit(write_entry, self.run_dir, n, rows, changes, meta)
        fut.add_done_callback(lambda f: self._entry_done(f, n, rows, changes, meta))
        return fut

    def entry_now(self, changes: list[tuple], meta: dict) -> None:
        """``entry``, written in the calling thread (a constructor, no event loop)."""
        if self.enabled and (changes or self.rows or self.orphans):
            write_entry(self.run_dir, *self._take_entry(changes, meta))

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

    def soon(self, write) -> None:
        """Call ``write`` (which starts an entry) within ``ENTRY_DELAY`` s: changes that
        come one trajectory at a time (cancellations, failures) share one entry."""
        if self._soon is None and self.enabled:
            self._soon = asyncio.get_running_loop().call_later(ENTRY_DELAY, self._due, write)

    def _due(self, write) -> None:
        self._soon = None
        write()

    def cancel_soon(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None

    async def compact(self, upto: int) -> None:
        """Merge the entries since the last checkpoint (``compact``) on the I/O thread,
        behind every entry already started; a failure costs only files."""
        if not self.enabled:
            return
        try:
            removed = await self.store.submit(compact, self.run_dir, upto)
            logger.debug("journal compacted before entry %d: %d files removed", upto, removed)
        except Exception as e:  # noqa: BLE001 - the journal is still whole: both replay
            logger.warning("compacting the journal under %s failed (%r); it stays as it is",
                           self.run_dir, e)
