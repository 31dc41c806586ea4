"""A ``SampleBuffer`` continued from durable state: a checkpoint's snapshot, or the run
dir's journal after the buffer's worker was lost.

* ``snapshot(buf, url)`` / ``restore(buf, url)``: the buffer's part of a checkpoint
  (``rollart.control.checkpoint``): ``buffer.parquet`` (every row held: buffered groups, complete
  or not, and taken ones) and ``buffer.json`` (counters, ledger totals, next part and
  journal entry, groups); a snapshot then compacts the journal entries written since the
  previous one (``journal.compact``). Called through ``SampleBuffer.snapshot/restore``.
* ``recover(buf)``: ``SampleBuffer(run_dir, recover=True)`` rebuilt from
  ``rollart.buffer.journal``: complete groups that were buffered are buffered again;
  taken batches stay taken for their step (the next ``get_table`` or ``release_taken``
  settles them); trajectories in flight on the lost buffer's ledger, and members of its
  incomplete groups (never durable), become ``failed`` (counted ``orphaned``; a late
  arrival of one is ignored) and their groups are closed; rows that left but never
  reached a part are written as one; the counts continue.
"""

from __future__ import annotations

import io
import json
import logging

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rollart.buffer import journal
from rollart.buffer.group import Group, Taken
from rollart.buffer.ledger import BUFFERED, FINAL, IN_FLIGHT, TAKEN
from rollart.buffer.schema import SCHEMA, read_parts, write_parquet
from rollart.types import TrajState

logger = logging.getLogger(__name__)


# -- checkpoints -------------------------------------------------------------------------
async def snapshot(buf, url: str) -> dict:
    """Write ``buffer.parquet`` and ``buffer.json`` under ``url``; rows that already left
    are flushed to ``samples/`` (and the ledger journaled) first, so ``next_part`` and
    ``next_entry`` mark exactly which files belong to the checkpointed run."""
    from rollart.runtime.storage import write_bytes

    async with buf._condition:
        await buf.flush()
        groups = [(g, True, None) for g in buf._complete.values()] + \
                 [(g, False, None) for g in buf._open.values()] + \
                 [(g, True, s) for s, t in buf._taken.items() for g in t.groups]
        batches = [b for g, _, _ in groups for b in g.arrow()]
        meta = {
            "counts": dict(buf._counts), "ledger": dict(buf.ledger.counts),
            "next_part": buf.store.parts, "next_entry": buf.store.next_entry,
            "taken": {str(s): t.meta() for s, t in buf._taken.items()},
            "groups": [{"id": g.group_id, "size": g.size, "arrived": g.arrived,
                        "rows": g.rows, "complete": done, "taken": step}
                       for g, done, step in groups],
        }
    out = io.BytesIO()
    pq.write_table(pa.Table.from_batches(batches, schema=SCHEMA), out)
    files = write_bytes(url, "buffer.parquet", out.getvalue())
    files.update(write_bytes(url, "buffer.json", json.dumps(meta, indent=1).encode()))
    await _compact(buf, meta["next_entry"])
    return files


async def _compact(buf, upto: int) -> None:
    """Merge the journal entries since the last checkpoint (``journal.compact``) on the
    buffer's I/O thread, behind every entry already started; a failure costs only files."""
    if buf.run_dir is None:
        return
    try:
        removed = await buf.store._submit(journal.compact, buf.run_dir, upto)
        logger.debug("journal compacted before entry %d: %d files removed", upto, removed)
    except Exception as e:  # noqa: BLE001 - the journal is still whole: both copies replay
        logger.warning("compacting the journal under %s failed (%r); it stays as it is",
                       buf.run_dir, e)


async def restore(buf, url: str) -> int:
    """Continue from a ``snapshot``: counters, ledger and the part and journal counters
    continue; complete groups are buffered again (in their order), taken ones stay taken;
    incomplete ones can never complete (their missing members died with the old run), so
    their rows are dropped. Trajectories in flight at the snapshot count as aborted.
    Part files and journal entries the old run wrote after the snapshot are moved to
    ``*/after-resume-{k}/`` so no trajectory appears trained twice. Returns rows buffered."""
    fs, root = fsspec.core.url_to_fs(str(url))
    root = root.rstrip("/")
    with fs.open(f"{root}/buffer.json", "r") as f:
        meta = json.load(f)
    with fs.open(f"{root}/buffer.parquet", "rb") as f:
        table = pq.read_table(io.BytesIO(f.read())).cast(SCHEMA)
    async with buf._condition:
        _counters(buf, meta.get("counts"))
        buf.store.parts = int(meta["next_part"])
        _set_aside_parts_after(buf.run_dir, buf.store.parts)
        state = {}
        if buf.run_dir is not None and "next_entry" in meta:
            buf.store.next_entry = int(meta["next_entry"])
            journal.set_aside(buf.run_dir, buf.store.next_entry)
            record = journal.read_ledger(buf.run_dir)
            state = {t: s for t, (s, _) in record.latest.items()}
            buf._orphans = set(record.orphans)
        buf.ledger.load(state, dict(meta["ledger"]))
        _abort_in_flight(buf)
        _groups_from(buf, meta, table)
        buf.ledger.check()
        buf._condition.notify_all()
    await buf.flush()
    return buf._buffered()


def _counters(buf, counts: dict | None) -> None:
    counts = counts or {}
    buf._counts = {k: int(counts.get(k, 0)) for k in buf._counts}


def _abort_in_flight(buf) -> None:
    """Trajectories in flight at the snapshot died with the old run: aborted."""
    for t in [t for t, s in buf.ledger.state.items() if s == IN_FLIGHT]:
        buf.ledger.move(t, TrajState.ABORTED.value)
    left = buf.ledger.counts[IN_FLIGHT]  # an old checkpoint: totals without ids
    if left:
        buf.ledger.counts[TrajState.ABORTED.value] += left
        buf.ledger.counts[IN_FLIGHT] = 0


def _groups_from(buf, meta: dict, table: pa.Table) -> None:
    rows_by_group: dict[str, list[int]] = {}
    for i, gid in enumerate(table.column("group_id").to_pylist()):
        rows_by_group.setdefault(gid, []).append(i)
    taken = {int(s): m for s, m in meta.get("taken", {}).items()}
    for info in meta["groups"]:
        part = table.take(pa.array(rows_by_group.get(info["id"], []), pa.int64())).combine_chunks()
        group = Group(info["id"], info["size"], arrived=info["arrived"],
                      batches=part.to_batches(), versions=part.column("version").to_pylist())
        step = info.get("taken")
        for traj_id in part.column("traj_id").to_pylist():  # ids an old checkpoint lacks
            buf.ledger.state.setdefault(traj_id, BUFFERED if step is None else TAKEN)
        if step is not None:
            buf._closed.add(group.group_id)
            _taken(buf, step, taken[step]).groups.append(group)
        elif info["complete"]:
            buf._complete[group.group_id] = group
        else:
            buf._closed.add(group.group_id)
            buf._leave(group.arrow(), TrajState.DROPPED)


def _taken(buf, step: int, meta: dict) -> Taken:
    if step not in buf._taken:
        buf._taken[step] = Taken(meta["min_version"], [], meta["take"])
    return buf._taken[step]


def _part_index(path: str) -> int:
    return int(path.rsplit("-", 1)[-1].split(".")[0])


def _set_aside_parts_after(run_dir: str | None, next_part: int) -> None:
    if run_dir is None:
        return
    fs, root = fsspec.core.url_to_fs(f"{run_dir}/samples")
    if not fs.exists(root):
        return
    later = [p for p in fs.glob(f"{root}/part-*.parquet") if _part_index(p) >= next_part]
    if later:
        k = len(fs.glob(f"{root}/after-resume-*"))
        fs.makedirs(f"{root}/after-resume-{k}", exist_ok=True)
        for p in later:
            fs.mv(p, f"{root}/after-resume-{k}/{p.rsplit('/', 1)[-1]}")


# -- recovery after the buffer's worker was lost -----------------------------------------
def recover(buf) -> dict:
    """Load the journal under ``buf.run_dir`` into the fresh buffer ``buf`` (in the
    constructor's thread); returns what it found (also ``buf.recovered``)."""
    run_dir = buf.run_dir
    record = journal.read_ledger(run_dir)
    parts = read_parts(run_dir)
    fs, root = fsspec.core.url_to_fs(f"{run_dir}/samples")
    names = fs.glob(f"{root}/part-*.parquet") if fs.exists(root) else []
    meta = record.meta or {}
    buf.store.parts = max([_part_index(p) + 1 for p in names] + [meta.get("next_part", 0)])
    buf.store.next_entry = record.next_entry
    pending = journal.read_pending(run_dir)
    state = {t: s for t, (s, _) in record.latest.items()}
    counts = dict(meta["ledger"]) if "ledger" in meta else None
    held = _held_groups(pending, record.latest)
    durable = {t for rows in held.values() for t in rows.column("traj_id").to_pylist()}
    never = [t for t, s in state.items() if s in (BUFFERED, TAKEN) and t not in durable]
    for t in never:  # an open group's member: never durable, so it never arrived
        if counts is not None:
            counts[state[t]] -= 1
            counts[IN_FLIGHT] = counts.get(IN_FLIGHT, 0) + 1
        state[t] = IN_FLIGHT
    buf.ledger.load(state, counts)
    _counters(buf, meta.get("counts"))
    buf._orphans = set(record.orphans)
    taken = {int(s): m for s, m in meta.get("taken", {}).items()}
    for gid, rows in held.items():
        group = Group(gid, rows.num_rows, arrived=rows.num_rows, batches=rows.to_batches(),
                      versions=rows.column("version").to_pylist())
        first = rows.column("traj_id")[0].as_py()
        if state[first] == BUFFERED:
            buf._complete[gid] = group
        else:
            step = record.latest[first][1]
            # the newest entry lists every step holding a batch; if the one that did was
            # unreadable, take the batch as not yet published (re-used, never "trained"
            # on a guess)
            meta_s = taken.get(step) or {"min_version": group.version, "take": "recovered"}
            _taken(buf, step, meta_s).groups.append(group)
    lost = [t for t, s in state.items() if s == IN_FLIGHT]
    buf._orphan(lost)
    seen = {t.rsplit("-", 1)[0] for t in state} | set(pending.column("group_id").to_pylist())
    buf._closed = seen - set(buf._complete)
    rewritten = _write_unwritten(buf, pending, parts, record.latest)
    buf.store.entry_now(buf.ledger.drain(), buf._meta())
    found = {"entries": record.next_entry, "buffered": buf._buffered(),
             "taken": sum(t.rows for t in buf._taken.values()),
             "orphaned": len(lost), "rewritten": rewritten}
    if record.next_entry:
        logger.warning("sample buffer recovered from %s: %s", run_dir, found)
    return found


def _held_groups(pending: pa.Table, latest: dict) -> dict[str, pa.Table]:
    """Rows of trajectories whose latest state is buffered or taken, by group, in the
    order their groups completed."""
    ids = pending.column("traj_id").to_pylist()
    keep = [i for i, t in enumerate(ids) if latest.get(t, ("",))[0] in (BUFFERED, TAKEN)]
    rows = pending.take(pa.array(keep, pa.int64()))
    by_group: dict[str, list[int]] = {}
    for i, gid in enumerate(rows.column("group_id").to_pylist()):
        by_group.setdefault(gid, []).append(i)
    return {gid: rows.take(idx).combine_chunks() for gid, idx in by_group.items()}


def _write_unwritten(buf, pending: pa.Table, parts: pa.Table, latest: dict) -> int:
    """Rows that left the lost buffer but reached no part: one part now (so the
    ``samples/`` parts hold every row that left). Returns rows written."""
    rows = journal.unwritten(pending, parts, latest)
    gone = [i for i, s in enumerate(rows.column("state").to_pylist()) if s in FINAL]
    if not gone:
        return 0
    write_parquet(rows.take(gone), f"{buf.run_dir}/samples/part-{buf.store.parts:05d}.parquet")
    buf.store.parts += 1
    return len(gone)
